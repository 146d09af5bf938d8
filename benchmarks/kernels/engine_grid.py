"""The paged kernels as the engine launches them: A/B of two kernel modules.

`bench_lora_kernels.py` sizes each launch to the batch's real work blocks.
The engine cannot: its batches are replayed from CUDA graphs, so a launch is
sized for the most work blocks a batch of that many tokens can have
(worker/pool.py `DevicePool._batch`: tokens / block + one partial block per
adapter). This runs the engine's own path (`DevicePool`: slot table of
`--loraserve-max-slots` 4096 slots, persistent token batches, `add_lora` for
qkv and o over 8 layers of Llama-2-7B shape, one CUDA graph per case) with
the current kernels and with a baseline module (e.g. the previous commit's
`triton_mbgmm.py`), in one process, and reports microseconds per layer.

    git show REV:src/vllm_loraserve/kernels/triton_mbgmm.py > /tmp/old_mbgmm.py
    python benchmarks/kernels/engine_grid.py --baseline /tmp/old_mbgmm.py --out r.json

(Session 3 of docs/benchmarks/e2e.md compared against REV = `adc8f41`.)

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys

import numpy as np
import torch
import triton

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer
from vllm_loraserve.worker.pool import DevicePool

H, LAYERS, PAGE = 4096, 8, 2 * 16 * 32 * 128
SLICES = tuple(SliceSpec(n, H, H) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
RANKS = (8, 16, 32, 64, 128)
# uniform-400: a power law over 400 adapters puts ~170 distinct in 512 tokens,
# near what the e2e pool-1000 run had per step (136, docs/benchmarks/e2e.md).
MIXES = {"single-r8": (1, (8,)), "uniform-32": (32, RANKS), "uniform-100": (100, RANKS),
         "uniform-400": (400, RANKS)}
TOKENS = (1, 16, 64, 256, 512, 2048, 8192)


def build(tokens: int, n: int, ranks: tuple[int, ...], dev: torch.device) -> tuple:
    g = torch.Generator(device=dev).manual_seed(0)
    pool = DevicePool(SLICES, LAYERS, 128, tokens, 4096, 3, "triton", dev)
    layout = LayerLayout(SLICES, PAGE)
    placements = [layout.place(ranks[i % len(ranks)], [s.name for s in SLICES]) for i in range(n)]
    total = sum(p.num_pages for p in placements) + 1
    pool.bind([torch.zeros(total, PAGE, dtype=torch.bfloat16, device=dev)
               for _ in range(LAYERS)])
    free = list(range(1, total))
    random.Random(0).shuffle(free)
    for i, p in enumerate(placements):
        ids = tuple(free.pop() for _ in range(p.num_pages))
        streams = torch.stack([pack_layer(layout, p, {
            s.name: (torch.randn(p.rank, H, generator=g, device=dev) / H ** 0.5,
                     torch.randn(H, p.rank, generator=g, device=dev) * 0.05) for s in SLICES},
            0.5, torch.bfloat16) for _ in range(LAYERS)])
        pool.load(i, i + 1, p, ids, streams)
    rng = np.random.default_rng(0)
    # Power-law popularity (alpha 1), as the e2e workload.
    w = 1.0 / np.arange(1, n + 1)
    pool.set_tokens(rng.choice(np.arange(1, n + 1), size=tokens, p=w / w.sum()), set())
    return pool


def time_graph(pool: DevicePool, tokens: int, dev: torch.device) -> tuple[float, torch.Tensor]:
    """(microseconds per layer, layer 0's qkv output from zero)."""
    qkv = ModuleSlices.of(pool.layout, ("q_proj", "k_proj", "v_proj"))
    o = ModuleSlices.of(pool.layout, ("o_proj",))
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16,
                    generator=torch.Generator(device=dev).manual_seed(1))
    y3 = torch.zeros(tokens, 3 * H, device=dev, dtype=torch.bfloat16)
    y1 = torch.zeros(tokens, H, device=dev, dtype=torch.bfloat16)
    pool.add_lora(0, qkv, x, y3)
    first = y3.clone()

    def step():
        for layer in range(LAYERS):
            pool.add_lora(layer, qkv, x, y3)
            pool.add_lora(layer, o, x, y1)
    step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1e3 / LAYERS, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="a triton_mbgmm.py to compare with")
    ap.add_argument("--out", required=True)
    ap.add_argument("--programs-per-sm", default="", help="comma-separated PROGRAMS_PER_SM "
                    "values to time the current kernels with (default: the module's)")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("baseline_mbgmm", a.baseline)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    from vllm_loraserve.kernels import triton_mbgmm as mbgmm
    from vllm_loraserve.kernels.triton_mbgmm import TritonBackend

    dev = torch.device("cuda")
    rows = []
    for mix, (n, ranks) in MIXES.items():
        for t in TOKENS:
            pool = build(t, n, ranks, dev)
            res, ys = {}, {}
            variants = [("baseline", old.TritonBackend(), None)] + [
                (f"new@{p}" if a.programs_per_sm else "new", TritonBackend(), p)
                for p in ([int(v) for v in a.programs_per_sm.split(",")] if a.programs_per_sm
                          else [mbgmm.PROGRAMS_PER_SM])]
            for name, backend, pps in variants:
                if pps is not None:
                    mbgmm.PROGRAMS_PER_SM = pps
                pool.backend = backend
                res[name], ys[name] = time_graph(pool, t, dev)
            # The same sums, up to split-K's fp32 atomics order and bf16 rounding.
            base = ys["baseline"].float()
            row = dict(mix=mix, tokens=t, max_abs=base.abs().max().item(),
                       **{f"{k}_us": round(v, 2) for k, v in res.items()},
                       **{f"speedup_{k}": round(res["baseline"] / v, 3)
                          for k, v in res.items() if k != "baseline"},
                       max_abs_diff=max((y.float() - base).abs().max().item()
                                        for y in ys.values()))
            print(row, flush=True)
            rows.append(row)
            del pool
            torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "layers": LAYERS, "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
