"""A page load's packing in one launch: the file's tensors, copied to the
device as the file holds them, into every layer's stream (paging/layout.py).

`paging.layout.pack_layers` does the same with torch: a few calls per slice,
plus a view per tensor (about 1,900 calls for a Llama-3-8B all-linear
adapter). The engine thread makes them, and the host tier's readers share
its GIL, so each call can wait for a reader: about 10 ms a load at 1000-2000
adapters on an H200 (docs/benchmarks/e2e.md, session 22). Here the host
passes a pack table (`paging.layout.pack_table`, built by the reader) and
launches once.

The numbers are pack_layers': A is cast to the stream's dtype; Bt = scaling
* B^T is computed in fp32 (torch's opmath for a 16-bit tensor times a Python
float), rounded to the file's dtype (the product's dtype in torch), then cast
to the stream's. Columns past a slice's width and ranks past the adapter's
are left as they are (the caller zeroes the streams).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_loraserve.paging.layout import PACK_COLUMNS

_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
RANK_ROWS = 16  # rank rows a program writes per step


@triton.jit(do_not_specialize=["rank", "stream_len", "layer_lo", "layer_hi"])
def _pack_kernel(src_ptr, table_ptr, out_ptr, scale, rank, stream_len, layer_lo, layer_hi,
                 NCOL: tl.constexpr, PANEL: tl.constexpr, BR: tl.constexpr,
                 OUT: tl.constexpr):
    """Program (row, panel p): the table row's segment, columns [p * PANEL,
    (p + 1) * PANEL), every rank row, into the stream of its layer."""
    t = table_ptr + tl.program_id(0) * NCOL
    layer = tl.load(t)
    src = tl.load(t + 1)
    cols = tl.load(t + 2)
    is_b = tl.load(t + 3)
    dst = tl.load(t + 4)
    c0 = tl.program_id(1) * PANEL
    if (c0 < cols) & (layer >= layer_lo) & (layer < layer_hi):
        offs_i = tl.arange(0, PANEL)
        c_mask = (c0 + offs_i) < cols
        # The segment's panel p: every rank row's PANEL columns, row after row.
        out = out_ptr + (layer - layer_lo) * stream_len + dst + c0 * rank
        for j0 in range(0, rank, BR):
            offs_j = j0 + tl.arange(0, BR)
            mask = (offs_j < rank)[:, None] & c_mask[None, :]
            if is_b != 0:  # Bt[j, c] = scale * B[c, j]; B is [cols, rank]
                v = tl.load(src_ptr + src + (c0 + offs_i)[None, :] * rank + offs_j[:, None],
                            mask=mask, other=0.0).to(tl.float32) * scale
                v = v.to(src_ptr.dtype.element_ty)  # torch's product is in the file's dtype
            else:  # A[j, c]; A is [rank, cols]
                v = tl.load(src_ptr + src + offs_j[:, None] * cols + (c0 + offs_i)[None, :],
                            mask=mask, other=0.0)  # the file's dtype, as the branch above
            tl.store(out + offs_j[:, None] * PANEL + offs_i[None, :], v.to(OUT), mask=mask)


def pack_streams(src: torch.Tensor, table: torch.Tensor, out: torch.Tensor, rank: int,
                 scaling: float, max_cols: int, panel: int, layers: range | None = None) -> None:
    """Write the streams of `layers` (default: all of `out`'s rows, from
    layer 0) into `out` ([len(layers), stream elements], zeroed by the
    caller), from `src` (the file's data as its dtype: one flat tensor on
    out's device) by `table` (int64 [rows, PACK_COLUMNS] on that device).
    `max_cols`: the widest slice's columns (the grid's panels)."""
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != len(PACK_COLUMNS):
        raise ValueError(f"a pack table is int64 [rows, {len(PACK_COLUMNS)}], got "
                         f"{table.dtype} {tuple(table.shape)}")
    if out.dtype not in _OUT_DTYPES or not out.is_contiguous() or out.dim() != 2:
        raise ValueError(f"streams must be a contiguous 2-d tensor of {list(_OUT_DTYPES)}")
    layers = range(out.shape[0]) if layers is None else layers
    if layers.step != 1 or len(layers) != out.shape[0]:
        raise ValueError(f"{out.shape[0]} streams for layers {layers}")
    if table.shape[0] == 0:
        return
    grid = (table.shape[0], triton.cdiv(max_cols, panel))
    _pack_kernel[grid](src, table, out, scaling, rank, out.shape[1], layers.start,
                       layers.stop, NCOL=len(PACK_COLUMNS), PANEL=panel, BR=RANK_ROWS,
                       OUT=_OUT_DTYPES[out.dtype])
