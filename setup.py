"""Builds the csrc/ CUDA op (vllm_loraserve._assist_ops) where it can be;
everything else about the package is in pyproject.toml.

The op is built when torch with CUDA and nvcc are there at build time, i.e.
`pip install --no-build-isolation` in an environment with CUDA torch (an
isolated build has no torch, so a plain `pip install` on a CPU machine never
tries). LORASERVE_BUILD_OPS: `auto` (default) builds it if it can and goes
on without it if it cannot, saying why; `1` makes any failure an error; `0`
skips it. Without the prebuilt op the package JIT-builds it at run time
from a source checkout, or runs without it (worker/assist_ops.py).
TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: the visible GPU's).
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

NAME = "vllm_loraserve._assist_ops"
SOURCE = "csrc/assist_ops.cu"


def _say(text: str) -> None:
    print(f"vllm-loraserve: {text}", file=sys.stderr)


def _cuda_op() -> dict:
    mode = os.environ.get("LORASERVE_BUILD_OPS", "auto")
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"LORASERVE_BUILD_OPS must be auto, 0 or 1, not {mode!r}")
    if mode == "0":
        _say("csrc/ op not built (LORASERVE_BUILD_OPS=0)")
        return {}
    why = None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        why = f"torch is not importable at build time ({exc}); build with --no-build-isolation"
    else:
        if torch.version.cuda is None:
            why = f"torch {torch.__version__} is not a CUDA build"
        elif CUDA_HOME is None:
            why = "nvcc not found (set CUDA_HOME)"
        elif not os.path.isfile(SOURCE):
            why = f"{SOURCE} is missing"
    if why is not None:
        if mode == "1":
            raise SystemExit(f"LORASERVE_BUILD_OPS=1 but the csrc/ op cannot be built: {why}")
        _say(f"csrc/ op not built: {why}")
        return {}

    class Build(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                if mode == "1":
                    raise
                _say(f"csrc/ op failed to build, going on without it: {exc}")

    _say(f"building the csrc/ op ({NAME}) with nvcc from {CUDA_HOME}")
    ext = CUDAExtension(NAME, [SOURCE], extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    ext.optional = mode == "auto"  # an editable install then skips copying a missing .so
    return {"ext_modules": [ext], "cmdclass": {"build_ext": Build}}


setup(**_cuda_op())
