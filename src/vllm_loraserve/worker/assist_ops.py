"""The sync-free CPU-assist op (csrc/assist_ops.cu), loaded if it can be.

`torch.ops.loraserve_assist.copy_to_host_and_flag(x, dst, flags, index,
value)` and `.wait_host_flag(flags, index, value, count=1, timeout_ns=0,
timeout_index=-1)`: both enqueue on the current CUDA stream and return at
once (Toppings Fig. 10, bottom); csrc/assist_ops.cu says what each does.
`flags` must be pinned and mapped host memory (a pinned
worker/cpu_lora/shm.py SharedSegment), `dst` pinned.

Where it comes from, in order:
1. the extension `pip install` built (setup.py: `vllm_loraserve._assist_ops`,
   where torch with CUDA and nvcc were there at build time);
2. a JIT build of csrc/assist_ops.cu with torch.utils.cpp_extension.load
   (ninja; cached under torch's extensions directory: the first start
   compiles for about a minute), from a source checkout.
Without CUDA, or when both fail, the project runs without it: `available()`
says why, and `log_availability()` says so once at start-up.

`HostOps` is the same two calls where the "device" is this host (x on the
CPU: CPU engines and the CPU suite): the same flags, set and awaited in the
same order, so `CpuWorkerPool.enqueue` and cpu-assist's use of it run on the
CPU unchanged. Its waits are the host's, which is what a CPU device means.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(f"vllm.{__name__}")

NAMESPACE = "loraserve_assist"
PREBUILT = "vllm_loraserve._assist_ops"
SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "assist_ops.cu"
_lock = threading.Lock()
_state: tuple[bool, str] | None = None
_logged = False


class AssistOpsUnavailable(RuntimeError):
    pass


class HostOps:
    """The op's calls for x on the CPU (see the module's doc)."""

    POLL_S = 20e-6

    @staticmethod
    def copy_to_host_and_flag(x: torch.Tensor, dst: torch.Tensor, flags: torch.Tensor,
                              index: int, value: int) -> None:
        if not (x.device.type == "cpu" and dst.is_contiguous() and dst.dtype == x.dtype
                and dst.numel() >= x.numel()):
            raise ValueError("dst must be a contiguous CPU tensor of x's dtype with room for x")
        dst.view(-1)[:x.numel()].copy_(x.reshape(-1))
        flags[index] = value  # after the rows, as the GPU's flag kernel

    @classmethod
    def wait_host_flag(cls, flags: torch.Tensor, index: int, value: int, count: int = 1,
                       timeout_ns: int = 0, timeout_index: int = -1) -> None:
        flat = flags.numpy()
        if timeout_index >= 0 and flat[timeout_index]:
            return  # an earlier wait gave up, as the GPU's kernel returns
        waited = flat[index:index + count]
        deadline = time.monotonic() + timeout_ns / 1e9
        while waited.min() < value:
            if timeout_ns and time.monotonic() > deadline:
                if timeout_index >= 0:
                    flags[timeout_index] = value
                return
            time.sleep(cls.POLL_S)


def _load() -> tuple[bool, str]:
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    spec = importlib.util.find_spec(PREBUILT)
    if spec is not None and spec.origin:
        try:
            torch.ops.load_library(spec.origin)
            return True, f"prebuilt {spec.origin}"
        except OSError as exc:  # built against another torch, say
            prebuilt = f"the prebuilt {spec.origin} does not load ({exc})"
    else:
        prebuilt = (f"no prebuilt {PREBUILT} (install with --no-build-isolation where torch "
                    f"with CUDA and nvcc are present)")
    from torch.utils import cpp_extension

    if not SOURCE.is_file():
        return False, f"{prebuilt}, and no csrc/ source to build"
    if cpp_extension.CUDA_HOME is None or not cpp_extension.is_ninja_available():
        return False, f"{prebuilt}, and a JIT build needs nvcc (CUDA_HOME) and ninja"
    logger.info("loraserve: %s; building %s with torch's JIT (about a minute, cached after)",
                prebuilt, SOURCE)
    try:
        path = cpp_extension.load(name="loraserve_assist_ops", sources=[str(SOURCE)],
                                  extra_cuda_cflags=["-O3"], is_python_module=False)
    except Exception as exc:  # a compiler's failure: reported, not raised
        return False, f"{prebuilt}, and the JIT build of {SOURCE} failed: {exc}"
    return True, f"JIT-built {path or 'loraserve_assist_ops'} from {SOURCE} ({prebuilt})"


def available() -> tuple[bool, str]:
    """(True, where it was loaded from) or (False, why not); tries once per process."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def ops():
    """torch.ops.loraserve_assist, or AssistOpsUnavailable with the reason."""
    ok, reason = available()
    if not ok:
        raise AssistOpsUnavailable(f"the csrc/ assist op is unavailable: {reason}")
    return getattr(torch.ops, NAMESPACE)


def log_availability() -> None:
    """One log line per process: whether the op is there, and why not."""
    global _logged
    ok, reason = available()
    if not _logged:
        _logged = True
        if ok:
            logger.info("loraserve: sync-free CPU-assist op loaded (%s)", reason)
        else:
            logger.info("loraserve: sync-free CPU-assist op unavailable (%s); the engine runs "
                        "without it", reason)

