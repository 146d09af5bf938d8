"""Triton MBGMM/MBGMV (S-LoRA §5.3): LoRA shrink and expand over paged
adapter weights of heterogeneous ranks.

One kernel pair serves prefill (blocks of many tokens of one adapter: MBGMM)
and decode (blocks of one or a few tokens: MBGMV); only the tile sizes differ.
Grid axes: shrink (work-block programs x split-K, slice), expand (work-block
programs, column block, slice). Work-block programs stride over the step's
blocks (their count is read on the device), and a shrink program loops over
rank tiles up to its slot's rank only, so the work follows the sum of the
ranks in the batch; the grid itself depends only on the most blocks a batch
of that many tokens can have (what a CUDA graph captured) and the device's
SM count (`block_programs`). Weights are read through the slot's page table: one
page lookup per (row, tile chunk), which the layout guarantees never crosses
a page; a tile's rows follow each other in the layout's panels, so a tile is
one contiguous run within a page (paging/layout.py).

Scaling is folded into Bt. Accumulation is fp32; the shrink output `h` is an
fp32 buffer [slices, tokens, max_rank], cast to the weight dtype for the
expand's tensor-core dot, as vLLM's expand does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from vllm_loraserve.kernels.batch import JOB_COLS, JOB_ROWS, ModuleSlices, SlotTable, TokenBatch
from vllm_loraserve.kernels.launch import Launcher
from vllm_loraserve.kernels.tile_table import Tiles, TileTable
from vllm_loraserve.paging.layout import LayerLayout


@triton.jit
def _panel_runs(page_row, seg_off, rank, c0, rows, mask, page_size, PANEL: tl.constexpr):
    """Pool offsets where the given rank rows of a segment hold column c0 (a
    multiple of a column tile that divides PANEL): the kernels' twin of
    paging/layout.py's panels. From there each row's tile is one run inside
    one page. Runs start at multiples of 16 (segment offsets, pages and
    panels are; `_check_panel`), which lets Triton issue wide loads."""
    chunk = seg_off + (c0 // PANEL) * rank * PANEL + rows * PANEL + c0 % PANEL
    page = tl.load(page_row + chunk // page_size, mask=mask, other=0)
    return tl.multiple_of(page.to(tl.int64) * page_size + chunk % page_size, 16)


@triton.jit
def _shrink_columns(x_ptr, pool_ptr, page_row, toks, m_mask, offs_n, n_mask, seg_off, rank,
                    k_lo, k_hi, K, page_size, stride_xt,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, PANEL: tl.constexpr):
    """x[toks, k_lo:k_hi] @ A[offs_n, k_lo:k_hi].T in fp32, BK columns a
    step: the two shrinks' inner loop (k_lo a multiple of BK)."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            x = tl.load(x_ptr + toks[:, None] * stride_xt + (k0 + offs_k)[None, :],
                        mask=m_mask[:, None], other=0.0)
            w_mask = n_mask[None, :]
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptr + toks[:, None] * stride_xt + (k0 + offs_k)[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = n_mask[None, :] & k_mask[:, None]
        base = _panel_runs(page_row, seg_off, rank, k0, offs_n, n_mask, page_size, PANEL)
        w = tl.load(pool_ptr + base[None, :] + offs_k[:, None], mask=w_mask, other=0.0)
        acc += tl.dot(x, w)
    return acc


@triton.jit
def _shrink_kernel(
    x_ptr, pool_ptr, h_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr, pages_ptr,
    K, page_size, num_segs, max_pages, seg0,
    stride_xt, stride_hs, stride_ht,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_H: tl.constexpr, PANEL: tl.constexpr,
):
    pid0 = tl.program_id(0)
    split = pid0 % SPLIT_K
    stride_blk = tl.num_programs(0) // SPLIT_K
    n0 = tl.program_id(1) * BN
    s = tl.program_id(2)
    offs_m = tl.arange(0, BM)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BK) * BK
    k_begin = split * k_span
    # Grid-stride over the step's work blocks: no program is launched for the
    # blocks a graph's worst case allows but the step does not have.
    for blk in range(pid0 // SPLIT_K, tl.load(nblocks_ptr), stride_blk):
        slot = tl.load(blocks_ptr + blk * 3)
        start = tl.load(blocks_ptr + blk * 3 + 1)
        length = tl.load(blocks_ptr + blk * 3 + 2)
        rank = tl.load(rank_ptr + slot)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        # The tokens are read beside the slot's entries, not after the test
        # below: one dependent round trip less before the weights.
        m_mask = offs_m < length
        toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
        if (seg_off >= 0) & (n0 < rank):  # rank tiles past the slot's rank: no work
            offs_n = n0 + tl.arange(0, BN)
            n_mask = offs_n < rank
            page_row = pages_ptr + slot * max_pages
            acc = _shrink_columns(x_ptr, pool_ptr, page_row, toks, m_mask, offs_n, n_mask,
                                  seg_off, rank, k_begin, tl.minimum(k_begin + k_span, K), K,
                                  page_size, stride_xt, BM, BN, BK, EVEN_K, PANEL)
            # Only columns below the rank: h past it is never read (no memset),
            # but where h was zeroed (EVEN_H: split-K, and the tile ends inside
            # h), the tile's columns past the rank add the masked weights' 0.
            out = h_ptr + s * stride_hs + toks[:, None] * stride_ht + offs_n[None, :]
            if EVEN_H:
                mask = m_mask[:, None]
            else:
                mask = m_mask[:, None] & n_mask[None, :]
            if SPLIT_K == 1:
                tl.store(out, acc, mask=mask)
            else:
                tl.atomic_add(out, acc, mask=mask)


ZERO_BLOCK = 256  # fp32 elements a stream-K program zeroes per store of the next h


@triton.jit(do_not_specialize=["next_numel"])
def _shrink_stream_kernel(
    x_ptr, pool_ptr, h_ptr, tok_ptr, rank_ptr, seg_ptr, pages_ptr, jobs_ptr, njobs_ptr,
    next_ptr, next_numel,
    K, page_size, num_segs, max_pages, seg0,
    stride_xt, stride_hs, stride_ht,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, COUNT: tl.constexpr,
    EVEN_K: tl.constexpr, PANEL: tl.constexpr, ZB: tl.constexpr, JC: tl.constexpr,
):
    """The shrink as stream-K over the step's work: a unit is BK input
    columns of one (job, slice) piece, units run piece by piece, and each
    program takes an equal run of consecutive units (a piece's partial sum is
    added into the zeroed h where the run starts or ends inside it). So every
    program of a fixed grid (a CUDA graph's) gets the same work, within one
    unit, whatever the step's jobs; the grid-stride shrink leaves programs
    idle or doubles some up. A job's row has JC (batch.JOB_COLS) entries.

    The programs also zero next_ptr[:next_numel], the next shrink's h (not
    this one's), in equal shares: that shrink then needs no memset launch.
    next_numel varies with the step's tokens: not specialised on, so one
    variant serves every step."""
    zper = tl.cdiv(tl.cdiv(next_numel, tl.num_programs(0)), ZB) * ZB
    z0 = tl.program_id(0) * zper
    for z in range(z0, tl.minimum(z0 + zper, next_numel), ZB):
        offs_z = z + tl.arange(0, ZB)
        tl.store(next_ptr + offs_z, tl.zeros((ZB,), tl.float32), mask=offs_z < next_numel)
    chunks = tl.cdiv(K, BK)
    units = tl.load(njobs_ptr) * COUNT * chunks
    per = tl.cdiv(units, tl.num_programs(0))
    u = tl.program_id(0) * per
    u_end = tl.minimum(u + per, units)
    offs_m = tl.arange(0, BM)
    while u < u_end:
        piece = u // chunks
        c0 = u % chunks
        c1 = tl.minimum(chunks, c0 + (u_end - u))
        job = piece // COUNT
        s = piece % COUNT
        # A job's row holds its block's (slot, start, length) and first rank
        # row: the slot's entries and the tokens are one round trip after it.
        slot = tl.load(jobs_ptr + job * JC)
        start = tl.load(jobs_ptr + job * JC + 1)
        length = tl.load(jobs_ptr + job * JC + 2)
        n0 = tl.load(jobs_ptr + job * JC + 3)
        rank = tl.load(rank_ptr + slot)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        m_mask = offs_m < length
        toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
        if (seg_off >= 0) & (n0 < rank):  # rank 0: a hidden slot
            offs_n = n0 + tl.arange(0, BN)
            n_mask = offs_n < rank
            page_row = pages_ptr + slot * max_pages
            acc = _shrink_columns(x_ptr, pool_ptr, page_row, toks, m_mask, offs_n, n_mask,
                                  seg_off, rank, c0 * BK, tl.minimum(c1 * BK, K), K,
                                  page_size, stride_xt, BM, BN, BK, EVEN_K, PANEL)
            out = h_ptr + s * stride_hs + toks[:, None] * stride_ht + offs_n[None, :]
            tl.atomic_add(out, acc, mask=m_mask[:, None] & n_mask[None, :])
        u += c1 - c0


@triton.jit
def _expand_kernel(
    h_ptr, pool_ptr, y_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr, pages_ptr,
    desc_ptr,
    page_size, num_segs, max_pages, seg0,
    stride_hs, stride_ht, stride_yt,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGNED: tl.constexpr,
    EVEN_H: tl.constexpr, PANEL: tl.constexpr,
):
    """A program takes one tile of BN columns of each work block it strides
    to, looping over the rank in BK rows. (Several column tiles per program,
    and a flat loop over (block, column tile) items, measured slower on an
    H200: docs/benchmarks/kernels.md, 2026-11-25.) EVEN_H: h is zero past
    each token's rank up to a multiple of BK (the shrink zeroed it), so its
    rows load unmasked."""
    s = tl.program_id(2)
    n_out = tl.load(desc_ptr + s * 2)
    col0 = tl.load(desc_ptr + s * 2 + 1)
    if ALIGNED:  # the launcher checked every slice's first column and width
        col0 = tl.multiple_of(col0, 16)
        # Known divisibility makes the column mask constant over 16 columns,
        # so y and B are read and written in vectors, not element by element.
        n_out = tl.multiple_of(n_out, 16)
    offs_m = tl.arange(0, BM)
    offs_j = tl.arange(0, BK)
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < n_out
    # Grid-stride over the step's work blocks (see _shrink_kernel).
    nblocks = tl.where(n0 < n_out, tl.load(nblocks_ptr), 0)
    for blk in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        slot = tl.load(blocks_ptr + blk * 3)
        start = tl.load(blocks_ptr + blk * 3 + 1)
        length = tl.load(blocks_ptr + blk * 3 + 2)
        seg_off = tl.load(seg_ptr + slot * num_segs + seg0 + 2 * s)
        rank = tl.load(rank_ptr + slot)
        m_mask = offs_m < length
        toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)  # beside seg_off
        if seg_off >= 0:
            h_rows = h_ptr + s * stride_hs + toks[:, None] * stride_ht
            out = y_ptr + toks[:, None] * stride_yt + col0 + offs_n[None, :]
            page_row = pages_ptr + slot * max_pages
            mask = m_mask[:, None] & n_mask[None, :]
            acc = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            for j0 in range(0, rank, BK):
                j_mask = (j0 + offs_j) < rank
                if EVEN_H:
                    hj = tl.load(h_rows + (j0 + offs_j)[None, :], mask=m_mask[:, None],
                                 other=0.0)
                else:
                    hj = tl.load(h_rows + (j0 + offs_j)[None, :],
                                 mask=m_mask[:, None] & j_mask[None, :], other=0.0)
                # The tile's rows follow each other in one panel.
                base = _panel_runs(page_row, seg_off, rank, n0, j0 + offs_j, j_mask, page_size,
                                   PANEL)
                w = tl.load(pool_ptr + base[:, None] + tl.arange(0, BN)[None, :],
                            mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                acc += tl.dot(hj.to(w.dtype), w)
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_pool_kernel(
    left_ptr, right_ptr, dpool_ptr, tok_ptr, blocks_ptr, nblocks_ptr, rank_ptr, seg_ptr,
    pages_ptr,
    n_cols, page_size, num_segs, max_pages, seg,
    stride_lt, stride_rt,
    BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PANEL: tl.constexpr,
):
    """dW[slot][j, n] += sum over the block's tokens t of left[t, j] * right[t, n],
    added into segment `seg`'s rows in the (fp32) pool gradient: dA from
    (dh, x), dBt from (h, dy). Blocks of one slot add into the same rows."""
    blk = tl.program_id(0)
    r0 = tl.program_id(1) * BR
    n0 = tl.program_id(2) * BN
    if n0 >= n_cols or blk >= tl.load(nblocks_ptr):
        return
    slot = tl.load(blocks_ptr + blk * 3)
    rank = tl.load(rank_ptr + slot)
    if r0 >= rank:
        return
    seg_off = tl.load(seg_ptr + slot * num_segs + seg)
    if seg_off < 0:
        return
    start = tl.load(blocks_ptr + blk * 3 + 1)
    length = tl.load(blocks_ptr + blk * 3 + 2)

    offs_r = r0 + tl.arange(0, BR)
    r_mask = offs_r < rank
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < n_cols
    acc = tl.zeros((BR, BN), dtype=tl.float32)
    for m0 in range(0, length, BM):
        offs_m = m0 + tl.arange(0, BM)
        m_mask = offs_m < length
        toks = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
        left = tl.load(left_ptr + toks[:, None] * stride_lt + offs_r[None, :],
                       mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        right = tl.load(right_ptr + toks[:, None] * stride_rt + offs_n[None, :],
                        mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(left).to(right.dtype), right)
    base = _panel_runs(pages_ptr + slot * max_pages, seg_off, rank, n0, offs_r, r_mask,
                       page_size, PANEL)
    tl.atomic_add(dpool_ptr + base[:, None] + tl.arange(0, BN)[None, :], acc,
                  mask=r_mask[:, None] & n_mask[None, :])


# The page count varies per load: not specialised (Triton would compile again
# for 1 page and for multiples of 16 while serving).
@triton.jit(do_not_specialize=["num_pages"])
def _write_pages_kernel(ptrs_ptr, src_ptr, ids_ptr, page_size, num_pages,
                        DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Page ids[i] of layer l <- row l, page i of src ([layers, num_pages *
    page_size]). A layer's pages are a tensor of their own (vLLM allocates
    each layer's KV apart), so its address comes from a table."""
    layer = tl.program_id(0)
    i = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_size
    dst = tl.load(ptrs_ptr + layer).to(tl.pointer_type(DTYPE))
    page = tl.load(ids_ptr + i).to(tl.int64)
    row = (layer.to(tl.int64) * num_pages + i) * page_size
    v = tl.load(src_ptr + row + offs, mask=mask)
    tl.store(dst + page * page_size + offs, v.to(DTYPE), mask=mask)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
WRITE_BLOCK = 4096  # elements a program copies


def shrink_tiles(batch: TokenBatch, k: int) -> Tiles:
    """Few tokens per block (decode) or many (prefill); `k`: input columns.
    Chosen by `benchmarks/kernels/engine_grid.py --sweep` on an H200 at the
    Llama-3-8B shapes, 200 adapters of ranks 16-64, 256 and 2048 tokens
    (docs/benchmarks/kernels.md, 2026-11-25): the same tiles were best or
    within noise at K 4096 and 14336 but for the ones split out here. Below
    ~100 tokens, the tiles of the 2026-11-21 tuning: the sweep's (tuned at
    256 tokens) made a layer of 1 to 64 tokens up to 1.6x slower. Column
    tiles are at most the layout's panel (128): down_proj's 256, the sweep's
    pick at decode heights, no longer fits one."""
    if batch.max_blocks <= 128:  # a few tokens: split K wide (the fixed cost is latency)
        return Tiles(block_n=32, block_k=128, split_k=16)
    if batch.block_m <= 16 and k <= 4096:
        return Tiles(block_n=16, block_k=128, split_k=4)
    if k > 4096:
        return Tiles(block_n=32, block_k=128, split_k=4)
    return Tiles(block_n=32, block_k=128, split_k=1)


def stream_tiles(batch: TokenBatch, k: int) -> Tiles:
    """The stream-K shrink's tiles (batches with jobs: the pool's): JOB_ROWS
    rank rows, no split (the stream splits K itself). Measured on an H100
    against the grid-stride shrink with `shrink_tiles` (docs/benchmarks/
    kernels.md, session 17); 48 registers let more programs share an SM at
    decode heights, where a 16-row tile had been best before."""
    if batch.max_blocks > 128 and batch.block_m <= 16 and k <= 4096:
        return Tiles(block_n=JOB_ROWS, block_k=128, max_regs=48)
    return Tiles(block_n=JOB_ROWS, block_k=128)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_split_k(k: int, block_k: int, programs: int, device: torch.device) -> int:
    """Split K until there are about four programs per SM (split-K adds fp32
    atomics, so no further), keeping at least two K chunks per program.
    `programs` is the grid before splitting: it depends on the batch's block
    count and the configured maximum rank, never on the ranks in the batch."""
    sms = _num_sms(device) if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(k, 2 * block_k), triton.cdiv(4 * sms, programs)))


PROGRAMS_PER_SM = 32
STREAM_PROGRAMS_PER_SM = 8  # the stream-K shrink's grid: about one wave of its programs


def block_programs(max_blocks: int, per_block: int, device: torch.device,
                   per_sm: int = 0) -> int:
    """Programs along the work-block axis: each strides over the step's
    blocks, so the grid holds about PROGRAMS_PER_SM programs per SM (with the
    `per_block` programs of the other axes) rather than one per block a
    CUDA graph's worst case allows; most of those would find no block and
    return, and their launches cost more than the LoRA work of small batches.
    Depends only on `max_blocks`, so a graph replays with the grid it captured."""
    sms = _num_sms(device) if device.type == "cuda" else 4
    return max(1, min(max_blocks, triton.cdiv((per_sm or PROGRAMS_PER_SM) * sms, per_block)))


def expand_tiles(batch: TokenBatch, n: int) -> Tiles:
    """As `shrink_tiles`; `n`: the widest slice's output columns. The sweep
    kept one column tile per program and 16 rank rows a step; a column tile
    is one panel (prefill's 256 was within 3% of 128 on panels:
    docs/benchmarks/kernels.md, session 18)."""
    if batch.max_blocks <= 128:
        return Tiles(block_n=128, block_k=32)
    return Tiles(block_n=128, block_k=16)


@dataclass(frozen=True)
class GradTiles:
    block_m: int = 32  # tokens per inner step; a program reduces over its whole block
    block_r: int = 32
    block_n: int = 64


def grad_tiles(batch: TokenBatch) -> GradTiles:
    """Not tuned yet: a first choice for the weight-gradient kernel."""
    return GradTiles()


@functools.lru_cache(maxsize=256)
def _desc(rows: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """(output columns, first output column) per slice. Cached here, not only
    in a launch plan: a captured CUDA graph keeps reading the tensor after
    `TritonBackend._bound_plans` drops the plan (a few shapes exist)."""
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _check_panel(layout: LayerLayout, *tile_sizes: int) -> None:
    """Column tiles must be multiples of 16 that divide the layout's panel: a
    tile's row is then one run inside one page, starting at a multiple of 16
    (what `_panel_runs` tells Triton)."""
    if layout.panel % 16:
        raise ValueError(f"the Triton kernels need a layout panel that is a multiple of 16, "
                         f"got {layout.panel} (align {layout.align})")
    for t in tile_sizes:
        if t % 16 or layout.panel % t:
            raise ValueError(f"column tile {t} must be a multiple of 16 that divides the "
                             f"layout's panel {layout.panel}: a tile could cross a page")


def _options(t: Tiles, device: torch.device) -> dict[str, int]:
    """A launch's compile options from its tiles: warps, pipeline stages and,
    on CUDA, a register cap (fewer registers a thread, more programs an SM;
    ROCm's Triton has no such option)."""
    opts = dict(num_warps=t.num_warps, num_stages=t.num_stages)
    if t.max_regs and device.type == "cuda" and not torch.version.hip:
        opts["maxnreg"] = t.max_regs
    return opts


MAX_PLANS = 4096  # launch plans a backend keeps (see TritonBackend._bound_plans)


class TritonBackend:
    name = "triton"

    def __init__(self, shrink_tiles=shrink_tiles, expand_tiles=expand_tiles,
                 grad_tiles=grad_tiles, stream_tiles=stream_tiles,
                 table: TileTable | None = None) -> None:
        """The tile functions must depend on a batch's `block_m` and
        `max_blocks` only (and the size given): a shrink's launch is kept per
        those, since every layer's shrink and expand of a step ask for it.
        `table`: tuned tiles (kernels/tile_table.py), before the functions."""
        self._rules = {"shrink": shrink_tiles, "stream": stream_tiles, "expand": expand_tiles}
        self.table = table
        self.table_keys_used: set = set()  # the table's entries some launch took
        self._grad_tiles = grad_tiles
        self._launches: dict[tuple, tuple[Tiles, int, tuple[int, int, int]]] = {}
        # Launch plans of the serving path's kernels, by what fixes their grid
        # and compile-time arguments (a few per module kind and batch shape).
        self._plans: dict[tuple, Any] = {}

    def _tiles(self, op: str, batch: TokenBatch, size: int, count: int) -> Tiles:
        """The table's tiles for this launch, else the op's rule's."""
        if self.table is not None:
            key = self.table.key(op, batch.max_blocks, batch.block_m, size, count)
            tuned = self.table.entries.get(key)
            if tuned is not None:
                self.table_keys_used.add(key)
                return tuned
        return self._rules[op](batch, size)

    def _bound_plans(self) -> None:
        """Serving needs a few plans per module kind and batch shape; eager
        callers (training) bring a new block count each step, so the table
        is emptied rather than grown without end."""
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()

    def page_writer(self, pages: list[torch.Tensor]):
        """Writes a load's pages of every layer in one launch (the torch
        backend's per-layer copies cost a host call each: ~100 a load at 32
        layers). `pages` must stay allocated: their addresses are kept."""
        first = pages[0]
        if any(p.shape != first.shape or p.dtype != first.dtype or not p.is_contiguous()
               for p in pages):
            raise ValueError("page views must be contiguous, of one shape and dtype")
        if first.dtype not in _TL_DTYPES:
            raise ValueError(f"the loraserve pool keeps adapters in KV pages of bf16, fp16 or "
                             f"fp32; this KV cache is {first.dtype} (use --loraserve-pool vllm)")
        ptrs = torch.tensor([p.data_ptr() for p in pages], dtype=torch.int64, device=first.device)
        page_size = first.shape[1]

        def write(page_ids: torch.Tensor, streams: torch.Tensor) -> None:
            n = page_ids.shape[0]
            if streams.shape != (len(pages), n * page_size) or not streams.is_contiguous():
                raise ValueError(f"streams {tuple(streams.shape)} do not hold {n} pages of "
                                 f"{page_size} elements for {len(pages)} layers")
            grid = (len(pages), n, triton.cdiv(page_size, WRITE_BLOCK))
            _write_pages_kernel[grid](ptrs, streams, page_ids, page_size, n,
                                      DTYPE=_TL_DTYPES[first.dtype], BLOCK=WRITE_BLOCK)
        return write

    def _shrink_launch(self, batch: TokenBatch, max_rank: int, k: int, count: int,
                       device: torch.device) -> tuple[Tiles, int, tuple[int, int, int]]:
        """Tiles, split-K and grid of a shrink; (block_m, tiles, split-K) is
        what Triton compiles a variant for (`warm_up`)."""
        key = (batch.block_m, batch.max_blocks, max_rank, k, count, device)
        launch = self._launches.get(key)
        if launch is None:
            t = self._tiles("shrink", batch, k, count)
            rank_blocks = triton.cdiv(max_rank, t.block_n)
            split_k = t.split_k or auto_split_k(k, t.block_k,
                                                batch.max_blocks * rank_blocks * count, device)
            grid = (block_programs(batch.max_blocks, split_k * rank_blocks * count,
                                   device, t.programs_per_sm) * split_k, rank_blocks, count)
            launch = self._launches[key] = (t, split_k, grid)
        return launch

    def _shrink(self, x, pool, h, batch, slots, layout, k, seg0, count,
                h_zeroed: bool = False, zero_next: torch.Tensor | None = None) -> None:
        """h[s, t, :rank] = x[t] @ (rows of segment seg0 + 2s).T for s < count;
        x has k columns. See `shrink` for `h_zeroed` and `zero_next`."""
        if batch.jobs is not None and batch.max_blocks:
            self._shrink_stream(x, pool, h, batch, slots, layout, k, seg0, count, h_zeroed,
                                zero_next)
            return
        if zero_next is not None:
            zero_next.zero_()
        if batch.max_blocks == 0:
            return
        t, split_k, grid = self._shrink_launch(batch, slots.max_rank, k, count, x.device)
        _check_panel(layout, t.block_k)
        if split_k > 1:  # the splits add into h
            h.zero_()
        _shrink_kernel[grid](
            x, pool, h, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev, slots.rank,
            slots.seg_offsets, slots.pages, k, layout.page_size,
            layout.num_segments, slots.pages.shape[1], seg0,
            x.stride(0), h.stride(0), h.stride(1),
            BM=batch.block_m, BN=t.block_n, BK=t.block_k, SPLIT_K=split_k,
            EVEN_K=k % t.block_k == 0, EVEN_H=split_k > 1 and h.shape[-1] % t.block_n == 0,
            PANEL=layout.panel, **_options(t, x.device),
        )

    def _shrink_stream(self, x, pool, h, batch, slots, layout, k, seg0, count, h_zeroed,
                       zero_next) -> None:
        """As `_shrink`, over the batch's jobs (stream-K): all of h zeroed
        first (unless it is already), each piece added into it; zero_next
        zeroed by the same launch. The grid is fixed by the device."""
        key = ("stream", batch.block_m, batch.max_blocks, k, count, layout.panel, x.device)
        launch = self._plans.get(key)
        if launch is None:
            self._bound_plans()
            t = self._tiles("stream", batch, k, count)
            if t.block_n != JOB_ROWS:
                raise ValueError(f"stream tiles of {t.block_n} rank rows for jobs of {JOB_ROWS}")
            _check_panel(layout, t.block_k)
            sms = _num_sms(x.device) if x.device.type == "cuda" else 4
            launch = self._plans[key] = Launcher(
                _shrink_stream_kernel, ((t.programs_per_sm or STREAM_PROGRAMS_PER_SM) * sms,),
                dict(BM=batch.block_m, BN=t.block_n, BK=t.block_k, COUNT=count,
                     EVEN_K=k % t.block_k == 0, PANEL=layout.panel, ZB=ZERO_BLOCK,
                     JC=JOB_COLS, **_options(t, x.device)))
        if not h_zeroed:
            h.zero_()
        if zero_next is not None and (zero_next.dtype != torch.float32
                                      or not zero_next.is_contiguous()):
            raise ValueError("zero_next must be a contiguous fp32 tensor")
        launch(x, pool, h, batch.sorted_tokens, slots.rank, slots.seg_offsets,
               slots.pages, batch.jobs, batch.num_jobs_dev,
               h if zero_next is None else zero_next,
               0 if zero_next is None else zero_next.numel(),
               k, layout.page_size, layout.num_segments, slots.pages.shape[1], seg0,
               x.stride(0), h.stride(0), h.stride(1))

    def _expand(self, h, pool, y, batch, slots, layout, desc_rows, seg0,
                h_zeroed: bool = False) -> None:
        """y[:, cols(s)] += h[s] @ (rows of segment seg0 + 2s), s < len(desc_rows),
        desc_rows: (output columns, first output column) per slice; slices
        must write disjoint columns (programs of different s run at once)."""
        if batch.max_blocks == 0:
            return
        key = ("expand", desc_rows, batch.block_m, batch.max_blocks, h_zeroed, h.shape[-1],
               layout.panel, y.device)
        plan = self._plans.get(key)
        if plan is None:
            self._bound_plans()
            n_max = max(n for n, _ in desc_rows)
            t = self._tiles("expand", batch, n_max, len(desc_rows))
            _check_panel(layout, t.block_n)
            col_blocks = triton.cdiv(n_max, t.block_n)
            grid = (block_programs(batch.max_blocks, col_blocks * len(desc_rows), y.device,
                                   t.programs_per_sm), col_blocks, len(desc_rows))
            plan = self._plans[key] = (_desc(tuple(desc_rows), y.device), Launcher(
                _expand_kernel, grid,
                dict(BM=batch.block_m, BN=t.block_n, BK=t.block_k,
                     ALIGNED=all(n % 16 == 0 and col % 16 == 0 for n, col in desc_rows),
                     EVEN_H=h_zeroed and h.shape[-1] % t.block_k == 0, PANEL=layout.panel,
                     **_options(t, y.device))))
        desc, launch = plan
        launch(h, pool, y, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev, slots.rank,
               slots.seg_offsets, slots.pages, desc,
               layout.page_size, layout.num_segments, slots.pages.shape[1], seg0,
               h.stride(0), h.stride(1), y.stride(0))

    def warm_up(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
                batches: list[TokenBatch], slots: SlotTable, module: ModuleSlices,
                layout: LayerLayout) -> int:
        """Compile, before serving, every kernel variant `shrink` and `expand`
        of `module` launch for these batch shapes (each with no work blocks,
        read on the device: the launches compute nothing). Variants differ by
        block height, tiles and split-K; everything else Triton specialises
        on (dtypes, strides, the layout's sizes) is fixed by the model.
        Returns the number of distinct variants launched."""
        seen = set()
        # As the pool's shrinks are launched: each zeroes the next one's h.
        zero_next = torch.zeros(16, dtype=torch.float32, device=h.device)
        for batch in batches:
            if batch.jobs is not None:  # the stream shrink; the expand reads a zeroed h
                shrink = ("stream", self._tiles("stream", batch, module.in_features,
                                                module.count))
            else:
                shrink = self._shrink_launch(batch, slots.max_rank, module.in_features,
                                             module.count, x.device)[:2]
            key = (batch.block_m, shrink,
                   self._tiles("expand", batch, max(module.out_features), module.count))
            if key not in seen:
                seen.add(key)
                self.shrink(x, pool, h, batch, slots, module, layout, zero_next=zero_next)
                self.expand(h, pool, y, batch, slots, module, layout)
        return len(seen)

    def shrink(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout,
               h_zeroed: bool = False, zero_next: torch.Tensor | None = None) -> None:
        """h[s, t, :rank] = x[t] @ A_{slot(t), s}.T. Where it splits K or runs
        on the batch's jobs (stream-K), all of h is zeroed first (stream-K:
        unless `h_zeroed`); otherwise no other entry of h is written.
        `zero_next`, on the stream-K path, is zeroed by the same launch."""
        self._shrink(x, pool, h, batch, slots, layout, module.in_features,
                     2 * module.first, module.count, h_zeroed, zero_next)

    def expand(self, h: torch.Tensor, pool: torch.Tensor, y: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout) -> None:
        """y[t, slice s columns] += h[s, t, :rank] @ Bt_{slot(t), s}; tokens
        without an adapter and untargeted slices are left as they are. h is
        what `shrink` of the same batch and module wrote: read up to each
        token's rank, or unmasked where that shrink zeroed it."""
        rows = module.out_rows
        if batch.max_blocks == 0:
            return
        # The shrink of this batch and module zeroed h if it ran on jobs
        # (stream-K) or split K.
        zeroed = batch.jobs is not None or self._shrink_launch(
            batch, slots.max_rank, module.in_features, module.count, h.device)[1] > 1
        self._expand(h, pool, y, batch, slots, layout, rows, 2 * module.first + 1,
                     h_zeroed=zeroed)

    # Backward: the same two kernels with the segments' roles swapped, one
    # slice per launch (each slice has its own input columns, or, for dx,
    # they all write the same columns), plus a segmented weight-gradient GEMM.

    def expand_grad_h(self, dy: torch.Tensor, pool: torch.Tensor, dh: torch.Tensor,
                      batch: TokenBatch, slots: SlotTable, module: ModuleSlices,
                      layout: LayerLayout) -> None:
        """dh[s, t, :rank] = dy[t, slice s columns] @ Bt_{slot(t), s}.T, no
        other entry of dh written: a shrink over the Bt segments."""
        for s, (col, n_out) in enumerate(zip(module.out_offsets, module.out_features,
                                             strict=True)):
            seg = 2 * (module.first + s) + 1
            self._shrink(dy[:, col:col + n_out], pool, dh[s:s + 1], batch, slots, layout,
                         n_out, seg, 1)

    def shrink_grad_x(self, dh: torch.Tensor, pool: torch.Tensor, dx: torch.Tensor,
                      batch: TokenBatch, slots: SlotTable, module: ModuleSlices,
                      layout: LayerLayout) -> None:
        """dx[t] += sum over slices s of dh[s, t, :rank] @ A_{slot(t), s}: an
        expand over the A segments (dh read up to each rank)."""
        for s in range(module.count):
            seg = 2 * (module.first + s)
            self._expand(dh[s:s + 1], pool, dx, batch, slots, layout,
                         ((module.in_features, 0),), seg)

    def grad_pool(self, x: torch.Tensor, h: torch.Tensor, dy: torch.Tensor, dh: torch.Tensor,
                  dpool: torch.Tensor, batch: TokenBatch, slots: SlotTable,
                  module: ModuleSlices, layout: LayerLayout) -> None:
        """A_{slot, s} += dh[s, toks].T @ x[toks], Bt_{slot, s} += h[s, toks].T @
        dy[toks, slice s columns], added into `dpool` (laid out as the pool).
        Accumulates in fp32 (atomics where a slot spans several blocks)."""
        if batch.max_blocks == 0:
            return
        t = self._grad_tiles(batch)
        _check_panel(layout, t.block_n)
        acc = dpool if dpool.dtype == torch.float32 else torch.zeros_like(dpool,
                                                                          dtype=torch.float32)
        for s, (col, n_out) in enumerate(zip(module.out_offsets, module.out_features,
                                             strict=True)):
            g = module.first + s
            for seg, left, right, n_cols in ((2 * g, dh[s], x, module.in_features),
                                             (2 * g + 1, h[s], dy[:, col:col + n_out], n_out)):
                grid = (batch.max_blocks, triton.cdiv(slots.max_rank, t.block_r),
                        triton.cdiv(n_cols, t.block_n))
                _grad_pool_kernel[grid](
                    left, right, acc, batch.sorted_tokens, batch.blocks, batch.num_blocks_dev,
                    slots.rank, slots.seg_offsets, slots.pages,
                    n_cols, layout.page_size, layout.num_segments,
                    slots.pages.shape[1], seg, left.stride(0), right.stride(0),
                    BM=t.block_m, BR=t.block_r, BN=t.block_n, PANEL=layout.panel,
                )
        if acc is not dpool:
            dpool += acc.to(dpool.dtype)
