"""Where a module's LoRA time goes on the engine's path: shrink (with its
memset of h) and expand timed apart, each as a CUDA graph over `LAYERS`
layers, beside the bytes each must read (the step's distinct adapters' A or
B) and the bytes its work blocks touch (an adapter with several blocks is
read once per block). Optional knobs, each timed against the defaults in
the same process:

- `--layer-gb G`: every layer's page tensor G GB, the adapters' pages
  scattered over it, as over a KV cache that fills the GPU (address
  translation over a large range);
- `--programs-per-sm N,...`: triton_mbgmm.PROGRAMS_PER_SM (the grid-stride
  programs per SM of both kernels);
- `--stream-programs-per-sm N,...`: triton_mbgmm.STREAM_PROGRAMS_PER_SM (the
  stream-K shrink's grid).

`--prefill-chunks N --chunk-tokens C` puts N prefill chunks of C tokens, each
of one adapter, in every step beside its decode tokens (engine_grid.build).
Each part also gets the activation bytes it must move: x read by the shrink
(`x_mb`), y read and written by the expand (`y_mb`).

`zero_us` is the shrink's memset of h alone (the stream-K shrink adds into
a zeroed h; `shrink_us` includes it).

    python benchmarks/kernels/kernel_parts.py --shape llama3-8b --targets all-linear \\
        --mixes pow-200 --tokens 256,768 --layer-gb 3.5 --programs-per-sm 8,128 --out p.json

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from engine_grid import LAYERS, MODULES, SHAPES, TARGETS, build, copy_tb_s, graph_us, save

from vllm_loraserve.kernels import triton_mbgmm
from vllm_loraserve.kernels.batch import ModuleSlices


def module_bytes(pool, m: ModuleSlices, batches) -> tuple[int, int, int, int]:
    """(A bytes, B bytes) of one layer of the step's distinct adapters, and
    the same summed over its work blocks (what the kernels read without
    reuse across blocks)."""
    ranks = pool.table.rank.cpu().numpy()
    a_per_rank = m.count * m.in_features * 2
    b_per_rank = sum(m.out_features) * 2
    slots_in_blocks = np.concatenate([b.blocks[:b.num_blocks, 0].cpu().numpy()
                                      for b in batches])
    distinct = np.unique(slots_in_blocks)
    r_distinct, r_blocks = ranks[distinct].sum(), ranks[slots_in_blocks].sum()
    return (int(r_distinct * a_per_rank), int(r_distinct * b_per_rank),
            int(r_blocks * a_per_rank), int(r_blocks * b_per_rank))


def parts(pool, kind: str, tokens: int, dev: torch.device) -> dict:
    m = ModuleSlices.of(pool.layout, MODULES[kind])
    x = torch.randn(tokens, m.in_features, device=dev, dtype=torch.bfloat16,
                    generator=torch.Generator(device=dev).manual_seed(1))
    y = torch.zeros(tokens, sum(m.out_features), device=dev, dtype=torch.bfloat16)
    h = pool.h_view(0, m.count, tokens)
    b = pool.backend
    batches = pool._batches_for(tokens)

    def zero():
        for _ in range(LAYERS):
            for _ in batches:
                h.zero_()

    def shrink():
        for layer in range(LAYERS):
            for batch in batches:
                b.shrink(x, pool.pages[layer], h, batch, pool.table, m, pool.layout)

    def expand():
        for layer in range(LAYERS):
            for batch in batches:
                b.expand(h, pool.pages[layer], y, batch, pool.table, m, pool.layout)

    def both():
        for layer in range(LAYERS):
            pool.add_lora(layer, m, x, y)

    shrink()  # h as the expand reads it
    out = {f"{name}_us": round(graph_us(fn) / LAYERS, 2)
           for name, fn in (("zero", zero), ("shrink", shrink), ("expand", expand),
                            ("both", both))}
    a, bb, a_blk, b_blk = module_bytes(pool, m, batches)
    out.update(a_mb=round(a / 1e6, 2), b_mb=round(bb / 1e6, 2),
               x_mb=round(x.numel() * 2 / 1e6, 2), y_mb=round(y.numel() * 4 / 1e6, 2),
               a_blocks_mb=round(a_blk / 1e6, 2), b_blocks_mb=round(b_blk / 1e6, 2),
               blocks=sum(bt.num_blocks for bt in batches))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all-linear")
    ap.add_argument("--mixes", default="pow-200")
    ap.add_argument("--tokens", default="16,256,768")
    ap.add_argument("--layer-gb", type=float, default=0.0)
    ap.add_argument("--programs-per-sm", default="")
    ap.add_argument("--stream-programs-per-sm", default="")
    ap.add_argument("--prefill-chunks", type=int, default=0)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    shape, kinds = SHAPES[a.shape], TARGETS[a.targets]
    peak = copy_tb_s(dev)
    print(f"copy: {peak:.2f} TB/s", flush=True)
    # Each variant: (name, layer GB, triton_mbgmm constants it sets).
    knobs = {"pps": "PROGRAMS_PER_SM", "spps": "STREAM_PROGRAMS_PER_SM"}
    defaults = {c: getattr(triton_mbgmm, c) for c in knobs.values()}
    variants = [("default", 0.0, {})]
    if a.layer_gb:
        variants.append((f"layer{a.layer_gb:g}gb", a.layer_gb, {}))
    for tag, values in (("pps", a.programs_per_sm), ("spps", a.stream_programs_per_sm)):
        variants += [(f"{tag}{n}", 0.0, {knobs[tag]: int(n)}) for n in values.split(",") if n]
    rows = []
    for mix in a.mixes.split(","):
        for t in (int(v) for v in a.tokens.split(",")):
            for name, layer_gb, consts in variants:
                for c, v in {**defaults, **consts}.items():
                    setattr(triton_mbgmm, c, v)
                pool, step_bytes, distinct = build(shape, kinds, mix, t, dev,
                                                   chunks=a.prefill_chunks,
                                                   chunk_tokens=a.chunk_tokens,
                                                   layer_gb=layer_gb)
                row = dict(mix=mix, tokens=t, variant=name, distinct=distinct,
                           prefill_chunks=a.prefill_chunks, chunk_tokens=a.chunk_tokens,
                           mb_per_layer=round(step_bytes / LAYERS / 1e6, 2))
                for kind in kinds:
                    p = parts(pool, kind, t, dev)
                    # Each part's bandwidth against the bytes it must read.
                    p["shrink_pct_copy"] = round(100 * p["a_mb"] / p["shrink_us"] / peak, 1)
                    p["expand_pct_copy"] = round(100 * p["b_mb"] / p["expand_us"] / peak, 1)
                    row[kind] = p
                row["layer_us"] = round(sum(row[k]["both_us"] for k in kinds), 2)
                row["pct_copy"] = round(100 * row["mb_per_layer"] / row["layer_us"] / peak, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del pool
                torch.cuda.empty_cache()
    for c, v in defaults.items():
        setattr(triton_mbgmm, c, v)
    save(a, peak, rows)


if __name__ == "__main__":
    main()
