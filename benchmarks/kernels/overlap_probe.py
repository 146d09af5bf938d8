"""Does the LoRA work hide behind the base GEMM on a second stream?

At the step sizes the e2e protocol runs (hundreds to thousands of tokens),
a layer's base GEMMs are compute-bound and the paged LoRA kernels are
memory-bound, and today they run one after the other on one stream. This
times one decoder layer's linear modules (the base GEMM of each, as vLLM's
unquantized linear runs it, plus the pool's LoRA through `DevicePool`), in
a CUDA graph over `engine_grid.LAYERS` layers, four ways:

- `base`: the GEMMs alone (`none`'s work);
- `seq`: each GEMM, then the pool's shrink and expand into its output (today);
- `shrink`: each module's shrink on a second stream beside its GEMM, then the
  expand into the GEMM's output on the main stream (no extra buffer);
- `dual`: vLLM's `VLLM_LORA_ENABLE_DUAL_STREAM` scheme: shrink and expand into
  a zeroed buffer on the second stream beside the GEMM, then one add.

It reports microseconds a layer, the LoRA's added time (variant minus
`base`), and the adapter bytes' time at the copy bandwidth measured in the
same process. Every variant's outputs are checked against `seq`'s first.

    cd benchmarks/kernels && PYTHONPATH=../../src python3 overlap_probe.py \\
        --shape llama3-8b --targets all-linear --mixes pow-200 --tokens 256,1024 --out o.json

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from engine_grid import LAYERS, MODULES, SHAPES, TARGETS, build, copy_tb_s, graph_us, save

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.worker import pool as pool_mod
from vllm_loraserve.worker.pool import DevicePool

VARIANTS = ("base", "seq", "shrink", "dual")


def shrink_half(pool: DevicePool, layer: int, m: ModuleSlices, x: torch.Tensor):
    """`DevicePool.add_lora`'s shrink alone (one batching: inputs of at most
    SMALL_BATCH rows); returns the expand, to run later into y."""
    tokens = x.shape[0]
    (batch,) = pool._batches_for(tokens)
    call = (layer, m.first)
    if call <= pool._last_call:
        pool._h_turn, pool._h_zeroed = 0, None
    pool._last_call = call
    turn = pool._h_turn
    h = pool.h_view(turn, m.count, tokens)
    pages = pool.pages[layer]
    pool.backend.shrink(x, pages, h, batch, pool.table, m, pool.layout,
                        h_zeroed=pool._h_zeroed == tokens, zero_next=pool._h_rows(1 - turn, tokens))
    pool._h_turn, pool._h_zeroed = 1 - turn, tokens
    return lambda y: pool.backend.expand(h, pages, y, batch, pool.table, m, pool.layout)


def make_layer(pool: DevicePool, kinds, tokens: int, shape: dict, dev: torch.device):
    """One step's function per variant, and the outputs it writes."""
    gen = torch.Generator(device=dev).manual_seed(1)
    mods = {k: ModuleSlices.of(pool.layout, MODULES[k]) for k in kinds}
    xs = {k: torch.randn(tokens, m.in_features, device=dev, dtype=torch.bfloat16, generator=gen)
          for k, m in mods.items()}
    ws = [{k: torch.randn(sum(m.out_features), m.in_features, device=dev, dtype=torch.bfloat16,
                          generator=gen) / m.in_features ** 0.5 for k, m in mods.items()}
          for _ in range(LAYERS)]
    outs = {k: torch.empty(tokens, sum(m.out_features), device=dev, dtype=torch.bfloat16)
            for k, m in mods.items()}
    zs = {k: torch.empty_like(y) for k, y in outs.items()}
    aux = torch.cuda.Stream(dev)

    def gemm(layer, k):
        torch.mm(xs[k], ws[layer][k].t(), out=outs[k])

    def step(variant):
        for layer in range(LAYERS):
            for k, m in mods.items():
                if variant == "base":
                    gemm(layer, k)
                elif variant == "seq":
                    gemm(layer, k)
                    pool.add_lora(layer, m, xs[k], outs[k])
                elif variant == "shrink":
                    main = torch.cuda.current_stream()
                    aux.wait_stream(main)
                    with torch.cuda.stream(aux):
                        expand = shrink_half(pool, layer, m, xs[k])
                    gemm(layer, k)
                    main.wait_stream(aux)
                    expand(outs[k])
                else:  # dual
                    main = torch.cuda.current_stream()
                    aux.wait_stream(main)
                    with torch.cuda.stream(aux):
                        zs[k].zero_()
                        pool.add_lora(layer, m, xs[k], zs[k])
                    gemm(layer, k)
                    main.wait_stream(aux)
                    outs[k].add_(zs[k])
    return step, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all-linear")
    ap.add_argument("--mixes", default="pow-200,single-r64")
    ap.add_argument("--tokens", default="64,256,512,1024,2048,4096")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if any(int(t) > pool_mod.SMALL_BATCH for t in a.tokens.split(",")):
        raise SystemExit(f"--tokens up to {pool_mod.SMALL_BATCH}: above, a layer's input runs "
                         "in two batchings, which shrink_half does not split")
    dev = torch.device("cuda")
    shape, kinds = SHAPES[a.shape], TARGETS[a.targets]
    peak = copy_tb_s(dev)
    print(f"copy: {peak:.2f} TB/s", flush=True)
    rows = []
    for mix in a.mixes.split(","):
        for t in (int(v) for v in a.tokens.split(",")):
            pool, step_bytes, distinct = build(shape, kinds, mix, t, dev)
            step, outs = make_layer(pool, kinds, t, shape, dev)
            row = dict(mix=mix, tokens=t, distinct=distinct,
                       bytes_us=round(step_bytes / LAYERS / peak / 1e6, 2))
            ref = None
            for v in VARIANTS:
                step(v)
                got = {k: y.clone() for k, y in outs.items()}
                if v == "seq":
                    ref = got
                elif ref is not None:
                    err = max((got[k].float() - ref[k].float()).abs().max().item() for k in got)
                    scale = max(ref[k].float().abs().max().item() for k in ref)
                    row[f"{v}_max_abs_diff"] = err
                    if err > 0.02 * scale + 1e-2:
                        raise AssertionError(f"{mix} {t} {v}: max diff {err} (scale {scale})")
                row[f"{v}_us"] = round(graph_us(functools.partial(step, v)) / LAYERS, 2)
            for v in VARIANTS[1:]:
                row[f"{v}_lora_us"] = round(row[f"{v}_us"] - row["base_us"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del pool, step, outs
            torch.cuda.empty_cache()
    save(a, peak, rows)


if __name__ == "__main__":
    main()
