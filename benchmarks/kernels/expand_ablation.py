"""Which of the expand's own costs keep it from the copy bandwidth: a copy
of `_expand_kernel` with each cost switchable, timed on the engine's path
(engine_grid.build: the pool, slot table and persistent batch of a
power-law step) as a CUDA graph over LAYERS layers. An ablated variant
computes wrong values on purpose: only its time counts, and every variant
reads the same weight bytes.

- YLOAD 0: the output tile is not read first (stored, not added);
- GATHER 0: y and h rows at the block's positions, not through the token list;
- PAGED 0: weights read at a linear address per (slot, row chunk), no page lookup;
- TILED 1: each [BK, BN] weight tile read as one contiguous run (long DRAM
  runs), instead of BK rows of BN columns a row width apart;
- COLS_FIRST 1: column tiles on the grid's fastest axis, so programs that
  run together read neighbouring columns of the same adapter's rows;
- the tile (BN columns x BK rank rows), warps and stages.

The copy addresses rows a row width apart (the layout before session 18's
panels): on the panel layout it reads the same bytes in that pattern.
`main` is the engine's expand (its own tiles); `wide-N` a panel-layout
expand that takes N column tiles of a block per program, the whole rank in
one tile (`_expand_wide`).

    python benchmarks/kernels/expand_ablation.py --tokens 256 --module gate_up --out abl.json

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from engine_grid import LAYERS, MODULES, SHAPES, TARGETS, build, copy_tb_s, graph_us

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.triton_mbgmm import block_programs


@triton.jit
def _expand_ablated(
    h_ptr, pool_ptr, y_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr, pages_ptr,
    desc_ptr, page_size, num_segs, max_pages, seg0, pool_elems,
    stride_hs, stride_ht, stride_yt,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    YLOAD: tl.constexpr, GATHER: tl.constexpr, PAGED: tl.constexpr, TILED: tl.constexpr,
    COLS_FIRST: tl.constexpr,
):
    s = tl.program_id(2)
    n_out = tl.multiple_of(tl.load(desc_ptr + s * 3 + 1), 16)
    width = tl.load(desc_ptr + s * 3)
    col0 = tl.multiple_of(tl.load(desc_ptr + s * 3 + 2), 16)
    if COLS_FIRST:
        pid_blk = tl.program_id(1)
        n_blk = tl.program_id(0)
        blk_step = tl.num_programs(1)
    else:
        pid_blk = tl.program_id(0)
        n_blk = tl.program_id(1)
        blk_step = tl.num_programs(0)
    offs_m = tl.arange(0, BM)
    offs_j = tl.arange(0, BK)
    n0 = n_blk * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < n_out
    nblocks = tl.where(n0 < n_out, tl.load(nblocks_ptr), 0)
    for blk in range(pid_blk, nblocks, blk_step):
        slot = tl.load(blocks_ptr + blk * 3)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        if seg_off >= 0:
            rank = tl.load(rank_ptr + slot)
            start = tl.load(blocks_ptr + blk * 3 + 1)
            length = tl.load(blocks_ptr + blk * 3 + 2)
            m_mask = offs_m < length
            if GATHER:
                toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
            else:
                toks = start + offs_m
            h_rows = h_ptr + s * stride_hs + toks[:, None] * stride_ht
            out = y_ptr + toks[:, None] * stride_yt + col0 + offs_n[None, :]
            page_row = pages_ptr + slot * max_pages
            mask = m_mask[:, None] & n_mask[None, :]
            if YLOAD:
                acc = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            for j0 in range(0, rank, BK):
                j_mask = (j0 + offs_j) < rank
                hj = tl.load(h_rows + (j0 + offs_j)[None, :], mask=m_mask[:, None], other=0.0)
                if TILED:
                    tile = ((slot.to(tl.int64) * 64 + j0) * 64 + n_blk * 8 + s) * (BK * BN)
                    base = tl.multiple_of(tile % (pool_elems - BK * BN), 16)
                    w = tl.load(pool_ptr + base + offs_j[:, None] * BN
                                + tl.arange(0, BN)[None, :],
                                mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                else:
                    chunk = seg_off + (j0 + offs_j) * width + n0
                    if PAGED:
                        page = tl.load(page_row + chunk // page_size, mask=j_mask, other=0)
                    else:
                        page = (slot * max_pages + chunk // page_size) % (pool_elems // page_size)
                    base = tl.multiple_of(page.to(tl.int64) * page_size + chunk % page_size, 16)
                    w = tl.load(pool_ptr + base[:, None] + tl.arange(0, BN)[None, :],
                                mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                acc += tl.dot(hj.to(w.dtype), w)
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_wide(
    h_ptr, pool_ptr, y_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr, pages_ptr,
    desc_ptr, page_size, num_segs, max_pages, seg0,
    stride_hs, stride_ht, stride_yt,
    BM: tl.constexpr, BN: tl.constexpr, RMAX: tl.constexpr, NCOL: tl.constexpr,
    PANEL: tl.constexpr,
):
    """On the panel layout: a program takes NCOL column tiles of each work
    block it strides to, with the whole rank in one tile (RMAX rows, masked
    past the slot's rank): the block's lookups and h once, then a flat loop
    over column tiles that the compiler can pipeline."""
    s = tl.program_id(2)
    n_out = tl.multiple_of(tl.load(desc_ptr + s * 3 + 1), 16)
    col0 = tl.multiple_of(tl.load(desc_ptr + s * 3 + 2), 16)
    offs_m = tl.arange(0, BM)
    offs_j = tl.arange(0, RMAX)
    g0 = tl.program_id(1) * NCOL * BN
    nblocks = tl.where(g0 < n_out, tl.load(nblocks_ptr), 0)
    for blk in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        slot = tl.load(blocks_ptr + blk * 3)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        if seg_off >= 0:
            rank = tl.load(rank_ptr + slot)
            start = tl.load(blocks_ptr + blk * 3 + 1)
            length = tl.load(blocks_ptr + blk * 3 + 2)
            m_mask = offs_m < length
            j_mask = offs_j < rank
            toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
            hj = tl.load(h_ptr + s * stride_hs + toks[:, None] * stride_ht + offs_j[None, :],
                         mask=m_mask[:, None], other=0.0).to(pool_ptr.dtype.element_ty)
            page_row = pages_ptr + slot * max_pages
            for c in range(NCOL):
                n0 = g0 + c * BN
                offs_n = n0 + tl.arange(0, BN)
                n_mask = offs_n < n_out
                out = y_ptr + toks[:, None] * stride_yt + col0 + offs_n[None, :]
                mask = m_mask[:, None] & n_mask[None, :]
                chunk = seg_off + (n0 // PANEL) * rank * PANEL + offs_j * PANEL + n0 % PANEL
                page = tl.load(page_row + chunk // page_size, mask=j_mask, other=0)
                base = tl.multiple_of(page.to(tl.int64) * page_size + chunk % page_size, 16)
                w = tl.load(pool_ptr + base[:, None] + tl.arange(0, BN)[None, :],
                            mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.load(out, mask=mask, other=0.0).to(tl.float32)
                acc += tl.dot(hj, w)
                tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def step_wide(pool, m: ModuleSlices, h, y, batch, desc, tile, ncol: int) -> None:
    bn, _, warps, stages = tile
    layout, table = pool.layout, pool.table
    col_groups = triton.cdiv(max(m.out_features), bn * ncol)
    bp = block_programs(batch.max_blocks, col_groups * m.count, y.device)
    for layer in range(LAYERS):
        _expand_wide[(bp, col_groups, m.count)](
            h, pool.pages[layer], y, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev,
            table.rank, table.seg_offsets, table.pages, desc, layout.page_size,
            layout.num_segments, table.pages.shape[1], 2 * m.first + 1,
            h.stride(0), h.stride(1), y.stride(0),
            BM=batch.block_m, BN=bn, RMAX=triton.next_power_of_2(table.max_rank), NCOL=ncol,
            PANEL=layout.panel, num_warps=warps, num_stages=stages)


def step_main(pool, m: ModuleSlices, h, y, batch) -> None:
    """The expand as the engine launches it (kernels/triton_mbgmm.py)."""
    for layer in range(LAYERS):
        pool.backend.expand(h, pool.pages[layer], y, batch, pool.table, m, pool.layout)


def step(pool, m: ModuleSlices, h, y, batch, desc, tile, flags: dict) -> None:
    """One expand of `m` per layer, with `flags` ablated."""
    bn, bk, warps, stages = tile
    layout, table = pool.layout, pool.table
    seg0 = 2 * m.first + 1
    col_blocks = triton.cdiv(max(m.out_features), bn)
    bp = block_programs(batch.max_blocks, col_blocks * m.count, y.device)
    cols_first = flags.get("cols_first", 0)
    grid = (col_blocks, bp, m.count) if cols_first else (bp, col_blocks, m.count)
    for layer in range(LAYERS):
        pool_t = pool.pages[layer]
        _expand_ablated[grid](
            h, pool_t, y, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev, table.rank,
            table.seg_offsets, table.pages, desc, layout.page_size, layout.num_segments,
            table.pages.shape[1], seg0, pool_t.numel(), h.stride(0), h.stride(1), y.stride(0),
            BM=batch.block_m, BN=bn, BK=bk, YLOAD=flags.get("yload", 1),
            GATHER=flags.get("gather", 1), PAGED=flags.get("paged", 1),
            TILED=flags.get("tiled", 0), COLS_FIRST=cols_first,
            num_warps=warps, num_stages=stages)


VARIANTS = {
    "real": {},
    "cols-first": dict(cols_first=1),
    "no-yload": dict(yload=0),
    "no-gather": dict(gather=0),
    "no-paging": dict(paged=0),
    "tiled": dict(tiled=1),
    "tiled-cols-first": dict(tiled=1, cols_first=1),
    "none-of-4": dict(yload=0, gather=0, paged=0, tiled=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--mix", default="pow-200")
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--modules", default="gate_up")
    ap.add_argument("--tiles", default="128x16w4t2,256x16w4t2,128x32w4t2,256x32w8t3",
                    help="BNxBK w(warps) t(stages), comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    peak = copy_tb_s(dev)
    print(f"copy: {peak:.2f} TB/s", flush=True)
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        pool, _, distinct = build(SHAPES[a.shape], TARGETS["all-linear"], a.mix, t, dev)
        table = pool.table
        batch = pool._batches_for(t)[0]
        ranks = table.rank.cpu()
        slots = batch.blocks[:batch.num_blocks, 0].cpu().unique()
        for module in a.modules.split(","):
            m = ModuleSlices.of(pool.layout, MODULES[module])
            h = pool.h_view(0, m.count, t)
            y = torch.zeros(t, sum(m.out_features), device=dev, dtype=torch.bfloat16)
            rows_ = [(pool.layout.width(2 * (m.first + s) + 1), n, col)
                     for s, (n, col) in enumerate(zip(m.out_features, m.out_offsets,
                                                      strict=True))]
            desc = torch.tensor(rows_, dtype=torch.int32, device=dev)
            b_mb = float(ranks[slots].sum()) * sum(m.out_features) * 2 / 1e6
            for tile in a.tiles.split(","):
                bn, rest = tile.split("x")
                bk, rest = rest.split("w")
                warps, stages = rest.split("t")
                cfg = tuple(map(int, (bn, bk, warps, stages)))
                for name in a.variants.split(","):
                    if name == "main":
                        run = functools.partial(step_main, pool, m, h, y, batch)
                    elif name.startswith("wide-"):
                        run = functools.partial(step_wide, pool, m, h, y, batch, desc, cfg,
                                                int(name.removeprefix("wide-")))
                    else:
                        run = functools.partial(step, pool, m, h, y, batch, desc, cfg,
                                                VARIANTS[name])
                    try:
                        us = graph_us(run) / LAYERS
                    except Exception as e:  # e.g. out of shared memory
                        print(f"{module} {tile} {name}: {type(e).__name__}: {e}", flush=True)
                        continue
                    row = dict(tokens=t, distinct=distinct, blocks=batch.num_blocks,
                               module=module, tile=tile, variant=name, us=round(us, 2),
                               b_mb=round(b_mb, 2), tb_s=round(b_mb / us, 3),
                               pct_copy=round(100 * b_mb / us / peak, 1))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        del pool
        torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "shape": a.shape, "mix": a.mix, "copy_tb_s": round(peak, 3), "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
