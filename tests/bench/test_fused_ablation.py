"""benchmarks/kernels/fused_ablation.py's one-launch module (interpreted on
the CPU) against the torch pool: every module kind, one and two batchings a
module, both h buffers NaN before each forward (a skipped zeroing, or a
segment or rank column read wrongly, puts NaN or a wrong sum into y), and
the ticket counters after the launches.

The interpreter runs programs one after another in ticket order, so no
expand program spins here: the device's synchronisation (the wait, its
target, release and acquire) is checked by the benchmark on a GPU, after
graph replays, not by this test."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tests.kernels.test_pool_triton import build, torch_and_triton_pools
from tests.worker.test_pool import KV_SHAPE, LAYERS
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.worker import pool as pool_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "fused_ablation", os.path.join(ROOT, "benchmarks", "kernels", "fused_ablation.py"))
fused = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fused
_spec.loader.exec_module(fused)


@pytest.mark.parametrize("small_batch", [64, 4])  # 4: two batchings (launches) a module
def test_one_launch_equals_the_pools_two(monkeypatch, small_batch):
    monkeypatch.setattr(pool_mod, "SMALL_BATCH", small_batch)
    monkeypatch.setattr(pool_mod, "TALL", 8)
    torch_pool, triton_pool, modules = torch_and_triton_pools()
    launcher = fused.FusedLauncher(per_sm=1)
    rng = np.random.default_rng(1)
    launches = 0
    for n in (9, 30):
        tokens = rng.choice([0, 11, 12], size=n, p=(0.2, 0.1, 0.7))
        triton_pool._h.fill_(float("nan"))
        for p in (torch_pool, triton_pool):
            p.set_tokens(tokens, ignored_ids=set())
        for layer in range(LAYERS):
            for m in modules:
                x = torch.randn(n + 2, m.in_features)  # 2 rows of padding: no adapter
                y0 = torch.randn(n + 2, sum(m.out_features))
                want, got = y0.clone(), y0.clone()
                torch_pool.add_lora(layer, m, x, want)
                fused.fused_add_lora(triton_pool, launcher, layer, m, x, got)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                assert torch.equal(got[n:], y0[n:])
                launches += len(triton_pool._batches_for(n + 2))
    # Each launch took S + E tickets and added S arrivals, and no counter
    # was reset: launch L of a plan finds tickets from L (S + E) on.
    assert sum(launcher.launches.values()) == launches > 0
    for (s, e, _), count in launcher.launches.items():
        assert launcher._sync[(s, e, torch.device("cpu"))].tolist() == [count * (s + e), count * s]


def test_it_refuses_a_batch_without_jobs():
    kv = [torch.zeros(KV_SHAPE) for _ in range(LAYERS)]
    p = build("triton", kv)
    p.set_tokens(np.zeros(4, dtype=np.int64), ignored_ids=set())
    m = ModuleSlices.of(p.layout, ("o_proj",))
    no_jobs = dataclasses.replace(p._batches_for(4)[0], jobs=None)
    with pytest.raises(ValueError, match="jobs"):
        fused.FusedLauncher(1)(torch.zeros(4, 64), p.pages[0], p.h_view(0, 1, 4),
                               torch.zeros(4, 64), no_jobs, p.table, m, p.layout, False,
                               p._h_rows(1, 4))


COMPILE = textwrap.dedent("""
    import importlib.util, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = importlib.util.spec_from_file_location("fused_ablation", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    ptrs = dict(x_ptr="*bf16", pool_ptr="*bf16", h_ptr="*fp32", y_ptr="*bf16",
                next_ptr="*fp32", sync_ptr="*i64")
    ints = ("tok_ptr", "rank_ptr", "seg_ptr", "pages_ptr", "jobs_ptr", "njobs_ptr",
            "blocks_ptr", "nblocks_ptr", "desc_ptr")
    sig = {**ptrs, **{p: "*i32" for p in ints}}
    for name in ("next_numel", "S", "E", "P0", "K", "page_size", "num_segs", "max_pages",
                 "seg0", "stride_xt", "stride_hs", "stride_ht", "stride_yt"):
        sig[name] = "i32"
    const = dict(BM=16, SBN=32, SBK=128, COUNT=3, EVEN_K=True, PANEL=128, ZB=256, JC=4,
                 EBN=128, EBK=32, COLB=32, ALIGNED=True)
    sig.update({c: "constexpr" for c in const})
    k = triton.compile(ASTSource(fn=mod._fused_kernel, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]
    print("compiled")
""")


def test_the_fused_kernel_compiles_for_sm90():
    """The interpreter does not type-check (tests/kernels/test_compile_sm90.py):
    the one-launch kernel, its spin and its loop-carried flag, compiled to a
    cubin for an H100/H200 without a GPU."""
    pytest.importorskip("triton")
    import triton.backends.nvidia  # noqa: F401
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT,
                                         env.get("PYTHONPATH", "")])
    path = os.path.join(ROOT, "benchmarks", "kernels", "fused_ablation.py")
    done = subprocess.run([sys.executable, "-c", f"PATH = {path!r}\n" + COMPILE], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "compiled"
