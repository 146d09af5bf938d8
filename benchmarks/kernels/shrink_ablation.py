"""Which of the shrink's own costs keep it from the bandwidth its tile shape
reaches alone (read_shapes.py): a copy of `_shrink_kernel` with each cost
switchable, timed on the engine's path (engine_grid.build: the pool, slot
table and persistent batch of a power-law step) as a CUDA graph over
LAYERS layers. An ablated variant computes wrong values on purpose: only
its time counts, and every variant reads the same weight bytes.

- ATOMIC 0: split-K partial sums stored, not added (the memset stays);
- GATHER 0: x rows read at the block's positions, not through the token list;
- PAGED 0: weights read at a linear address per (slot, chunk), no page lookup;
- the tile (BN rank rows x BK columns), split-K, warps and stages.

    python benchmarks/kernels/shrink_ablation.py --tokens 256 --module qkv --out abl.json

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from engine_grid import LAYERS, MODULES, SHAPES, TARGETS, build, graph_us

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.triton_mbgmm import block_programs


@triton.jit
def _shrink_ablated(
    x_ptr, pool_ptr, h_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr, pages_ptr,
    K, a_width, page_size, num_segs, max_pages, seg0, pool_pages,
    stride_xt, stride_hs, stride_ht,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    jobs_ptr, STORE: tl.constexpr, GATHER: tl.constexpr, PAGED: tl.constexpr,
    JOBS: tl.constexpr,
):
    pid0 = tl.program_id(0)
    split = pid0 % SPLIT_K
    s = tl.program_id(2)
    if JOBS:  # one (block, rank tile) job per program, from a host-built list
        first = tl.load(jobs_ptr + 2 * (pid0 // SPLIT_K))
        n0 = tl.load(jobs_ptr + 2 * (pid0 // SPLIT_K) + 1)
        end = first + 1
        stride_blk = 1
    else:
        first = pid0 // SPLIT_K
        end = tl.load(nblocks_ptr)
        stride_blk = tl.num_programs(0) // SPLIT_K
        n0 = tl.program_id(1) * BN
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BK) * BK
    k_begin = split * k_span
    for blk in range(first, end, stride_blk):
        slot = tl.load(blocks_ptr + blk * 3)
        rank = tl.load(rank_ptr + slot)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        if (seg_off >= 0) & (n0 < rank):
            start = tl.load(blocks_ptr + blk * 3 + 1)
            length = tl.load(blocks_ptr + blk * 3 + 2)
            m_mask = offs_m < length
            if GATHER:
                toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
            else:
                toks = start + offs_m
            offs_n = n0 + tl.arange(0, BN)
            n_mask = offs_n < rank
            row_start = seg_off + offs_n * a_width
            page_row = pages_ptr + slot * max_pages
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(k_begin, tl.minimum(k_begin + k_span, K), BK):
                x = tl.load(x_ptr + toks[:, None] * stride_xt + (k0 + offs_k)[None, :],
                            mask=m_mask[:, None], other=0.0)
                chunk = row_start + k0
                if PAGED:
                    page = tl.load(page_row + chunk // page_size, mask=n_mask, other=0)
                else:
                    page = (slot * max_pages + chunk // page_size) % pool_pages
                base = tl.multiple_of(page.to(tl.int64) * page_size + chunk % page_size, 16)
                w = tl.load(pool_ptr + base[None, :] + offs_k[:, None], mask=n_mask[None, :],
                            other=0.0)
                acc += tl.dot(x, w)
            out = h_ptr + s * stride_hs + toks[:, None] * stride_ht + offs_n[None, :]
            mask = m_mask[:, None] & n_mask[None, :]
            if STORE:  # no split, or the atomics ablated
                tl.store(out, acc, mask=mask)
            else:
                tl.atomic_add(out, acc, mask=mask)


def job_list(batch, table, bn: int) -> torch.Tensor:
    """(block, first rank row) of every rank tile the step's blocks hold."""
    ranks = table.rank.cpu().tolist()
    blocks = batch.blocks[:batch.num_blocks].cpu().tolist()
    jobs = [(b, n0) for b, (slot, _, _) in enumerate(blocks)
            for n0 in range(0, ranks[slot], bn)]
    return torch.tensor(jobs, dtype=torch.int32, device=batch.blocks.device)


def step(pool, m: ModuleSlices, x, h, batch, grid, tile, flags: dict) -> None:
    """One shrink of `m` per layer, with `flags` ablated."""
    bn, bk, split, warps, stages, maxnreg = tile
    layout, table = pool.layout, pool.table
    seg0 = 2 * m.first
    jobs = flags.get("jobs")
    if jobs is not None:
        grid = (jobs.shape[0] * split, 1, m.count)
    for layer in range(LAYERS):
        if split > 1:
            h.zero_()
        _shrink_ablated[grid](
            x, pool.pages[layer], h, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev,
            table.rank, table.seg_offsets, table.pages, m.in_features, layout.width(seg0),
            layout.page_size, layout.num_segments, table.pages.shape[1], seg0,
            pool.pages[layer].shape[0], x.stride(0), h.stride(0), h.stride(1),
            jobs_ptr=jobs if jobs is not None else batch.blocks,
            BM=batch.block_m, BN=bn, BK=bk, SPLIT_K=split,
            STORE=split == 1 or not flags.get("atomic", 1), GATHER=flags.get("gather", 1),
            PAGED=flags.get("paged", 1), JOBS=jobs is not None, num_warps=warps, num_stages=stages,
            **({"maxnreg": maxnreg} if maxnreg else {}))


VARIANTS = {
    "real": {},
    "no-atomic": dict(atomic=0),
    "no-gather": dict(gather=0),
    "no-paging": dict(paged=0),
    "none-of-3": dict(atomic=0, gather=0, paged=0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--mix", default="pow-200")
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--module", default="qkv")
    ap.add_argument("--tiles", default="16x128s4w4t2,32x128s4w4t2,64x128s4w4t2,64x128s4w8t2",
                    help="BNxBK s(split) w(warps) t(stages) [r(maxnreg)], comma-separated")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        pool, step_bytes, distinct = build(SHAPES[a.shape], TARGETS["all-linear"], a.mix, t, dev)
        m = ModuleSlices.of(pool.layout, MODULES[a.module])
        table = pool.table
        x = torch.randn(t, m.in_features, device=dev, dtype=torch.bfloat16)
        h = pool.h_view(0, m.count, t)
        batch = pool._batches_for(t)[0]
        ranks = table.rank.cpu()
        slots = batch.blocks[:batch.num_blocks, 0].cpu().unique()
        a_mb = float(ranks[slots].sum()) * m.count * m.in_features * 2 / 1e6
        for tile in a.tiles.split(","):
            bn, rest = tile.split("x")
            bk, rest = rest.split("s")
            split, rest = rest.split("w")
            warps, rest = rest.split("t")
            stages, _, maxnreg = rest.partition("r")
            bn, bk, split, warps, stages = map(int, (bn, bk, split, warps, stages))
            maxnreg = int(maxnreg or 0)
            rank_blocks = triton.cdiv(table.max_rank, bn)
            grid = (block_programs(batch.max_blocks, split * rank_blocks * m.count, dev) * split,
                    rank_blocks, m.count)
            variants = {**VARIANTS, "jobs": dict(jobs=job_list(batch, table, bn)),
                        "jobs-none-of-3": dict(jobs=job_list(batch, table, bn), atomic=0,
                                               gather=0, paged=0)}
            for name, flags in variants.items():
                run = functools.partial(step, pool, m, x, h, batch, grid, (bn, bk, split, warps,
                                                                           stages, maxnreg), flags)
                us = graph_us(run) / LAYERS
                row = dict(tokens=t, distinct=distinct, module=a.module, tile=tile,
                           variant=name, us=round(us, 2), a_mb=round(a_mb, 2),
                           tb_s=round(a_mb / us, 3))
                print(json.dumps(row), flush=True)
                rows.append(row)
        del pool
        torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "shape": a.shape, "mix": a.mix, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
