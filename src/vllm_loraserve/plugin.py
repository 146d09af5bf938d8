"""`vllm.general_plugins` entry point: runs in every vLLM process.

vLLM calls `register()` in the API server (while it builds the `vllm serve`
parser, before arguments are parsed), in the engine core and in every worker.
An installed plugin that nobody asked for patches nothing: `register()`
installs its patches only in a process where the plugin was requested:
- `vllm serve` with `--plugin loraserve`, a `--loraserve-*` flag, or an
  `--additional-config` holding the `loraserve` key (read from `sys.argv`);
- Python `LLM(..., additional_config={"loraserve": ...})`, and the engine
  core and workers of any requested engine: vLLM loads plugins from
  `EngineArgs.__post_init__`, `EngineCore.__init__(vllm_config)` and
  `WorkerWrapperBase.init_worker` (where `vllm_config` is a local), so the
  config being built is on the caller's stack (compat.CONTRACT checks
  those call sites).

Before patching, every vLLM symbol the plugin relies on is checked
(compat.CONTRACT). On an unsupported vLLM version or a moved symbol, a
requested plugin stops the process with the reason; an unrequested one
only logs it (checking the symbols of modules already imported, so that it
imports nothing).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import MutableMapping
from types import FrameType

from vllm_loraserve.config import ADDITIONAL_CONFIG_KEY

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format


def _has_key(value: str) -> bool:
    try:
        parsed = json.loads(value)
    except ValueError:
        return False
    return isinstance(parsed, dict) and ADDITIONAL_CONFIG_KEY in parsed


def requested_on_command_line(argv: list[str]) -> bool:
    """`--plugin loraserve`, any `--loraserve-*` flag (config_from_args then
    says it needs --plugin), or `--additional-config` with the key."""
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        flag, _, inline = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag == "--plugin" and (inline or nxt) == ADDITIONAL_CONFIG_KEY:
            return True
        if flag.startswith("--loraserve-"):
            return True
        if flag == "--additional-config" and _has_key(inline or nxt):
            return True
        if flag.startswith(f"--additional-config.{ADDITIONAL_CONFIG_KEY}"):
            return True
    return False


def _config_on_stack(frame: FrameType | None) -> dict | None:
    """The `additional_config` of the EngineArgs or VllmConfig that vLLM code
    up the stack is loading plugins for, if any."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("vllm."):
            local = frame.f_locals
            for obj in (local.get("vllm_config"), local.get("self")):
                extra = getattr(obj, "__dict__", {}).get("additional_config")
                if isinstance(extra, dict):
                    return extra
        frame = frame.f_back
    return None


def requested(argv: list[str], frame: FrameType | None) -> bool:
    if requested_on_command_line(argv):
        return True
    extra = _config_on_stack(frame)
    return extra is not None and ADDITIONAL_CONFIG_KEY in extra


def _refuse_or_warn(message: str, wanted: bool) -> None:
    if wanted:
        raise SystemExit(message)
    logger.warning("%s", message)


# The host tier's arena (worker/arena.py, up to 32 GiB) is pinned at start-up.
# Pinned blocks made by malloc and cudaHostRegister on 8 threads instead of
# cudaHostAlloc: on the H200 machine, 4 readers into new pinned blocks reached
# 7.9 GB/s instead of 2.5 GB/s (benchmarks/e2e/read_path.py;
# docs/benchmarks/e2e.md, session 5).
PINNED_ALLOC_CONF = {"pinned_use_cuda_host_register": "True", "pinned_num_register_threads": "8"}
# Torch versions differ in which name they read first; both are kept in step.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_registered_pinned_memory(environ: MutableMapping[str, str]) -> None:
    """Add PINNED_ALLOC_CONF's settings that the user did not give to
    torch's allocator settings in `environ` (every variable that is set, or
    PYTORCH_CUDA_ALLOC_CONF). Torch reads them at a process's first CUDA
    allocation, so they reach the engine processes started after this (a
    process whose CUDA is already initialized keeps torch's default)."""
    for var in [v for v in ALLOC_CONF_VARS if v in environ] or ALLOC_CONF_VARS[:1]:
        conf = environ.get(var, "")
        given = {item.split(":", 1)[0].strip() for item in conf.split(",") if item.strip()}
        extra = [f"{k}:{v}" for k, v in PINNED_ALLOC_CONF.items() if k not in given]
        if extra:
            environ[var] = ",".join([conf] + extra if conf else extra)


def install() -> None:
    """Install every patch (idempotent). Each stays dormant for an engine
    whose config lacks the `loraserve` key."""
    from vllm_loraserve.frontend import args, endpoint, graph_sizes
    from vllm_loraserve.scheduler import scheduler
    from vllm_loraserve.worker import hooks, rendezvous

    use_registered_pinned_memory(os.environ)
    args.install()
    graph_sizes.install()
    endpoint.install_gate()
    scheduler.install()
    hooks.install()
    rendezvous.install()


def register() -> None:
    from vllm_loraserve._patching import PatchTargetMissing
    from vllm_loraserve.compat import (
        UnsupportedVLLMVersion,
        check_supported,
        contract_problems,
    )

    wanted = requested(sys.argv, sys._getframe(1))
    try:
        check_supported()
    except UnsupportedVLLMVersion as e:
        _refuse_or_warn(str(e), wanted)
        return
    # Unrequested, only what this process already imported is checked: an
    # inactive plugin must not make stock vLLM import anything.
    problems = contract_problems(loaded_only=not wanted)
    if problems:
        _refuse_or_warn(
            "vllm-loraserve cannot patch this vLLM: " + "; ".join(problems)
            + ". The plugin stays inactive" + (" and vLLM stops, as it was requested."
                                                if wanted else "."), wanted)
        return
    if not wanted:
        return
    try:
        install()
    except PatchTargetMissing as e:
        raise SystemExit(f"vllm-loraserve cannot patch this vLLM: {e}") from None
