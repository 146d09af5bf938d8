"""The pack kernel compiles for an H100/H200 (sm_90) on this CPU machine.

The CPU suite runs kernels under TRITON_INTERPRET=1, which does not type-check
them: a kernel whose branches give a value two dtypes ran here and failed to
compile on the GPU (session 23). Triton's compiler needs no GPU up to the
cubin, so a subprocess without the interpreter compiles each variant that the
GPU test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_loraserve.kernels.triton_pack import _pack_kernel
    from vllm_loraserve.paging.layout import PACK_COLUMNS
    names = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    for pair in PAIRS:
        src, out = pair.split("-")
        sig = dict(src_ptr="*" + src, table_ptr="*i64", out_ptr="*" + out, scale="fp32",
                   rank="i32", stream_len="i32", layer_lo="i32", layer_hi="i32",
                   NCOL="constexpr", PANEL="constexpr", BR="constexpr", OUT="constexpr")
        const = dict(NCOL=len(PACK_COLUMNS), PANEL=128, BR=16, OUT=names[out])
        k = triton.compile(ASTSource(fn=_pack_kernel, signature=sig, constexprs=const),
                           target=GPUTarget("cuda", 90, 32))
        assert k.asm["cubin"], pair
        print("compiled", pair)
""")

# (file dtype, stream dtype): tests/gpu/test_load_sync_gpu.py's pairs
PAIRS = ["bf16-bf16", "fp32-bf16", "bf16-fp16", "fp16-bf16", "fp16-fp32"]


def test_pack_kernel_compiles_for_sm90():
    pytest.importorskip("triton")  # none off x86_64; CI pins it (pyproject's test extra)
    import triton.backends.nvidia  # noqa: F401  (a Triton without it cannot check this)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default; silences its warning
    done = subprocess.run([sys.executable, "-c", f"PAIRS = {PAIRS!r}\n" + SCRIPT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == [f"compiled {p}" for p in PAIRS]
