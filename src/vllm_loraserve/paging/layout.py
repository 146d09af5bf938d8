"""How one adapter's weights sit in fixed-size pages: the single definition.

Per layer, an adapter is a stream of *segments*, one pair per slice it adapts
(a slice is one PEFT module: q_proj, k_proj, ..., down_proj):

    A  segment: rank rows of `in_features`  elements  (row j = A[j, :])
    Bt segment: rank rows of `out_features` elements  (row j = scaling * B[:, j])

at the adapter's true rank (S-LoRA §5.1; B is stored transposed so both
kernels read rows of the rank). Every row is padded to a multiple of `align`
elements, and a segment is stored in *panels* of `panel` columns: panel p
holds columns [p * panel, (p + 1) * panel) of all rank rows, row after row,
so element (j, c) of a segment at offset `off` sits at

    off + (c // panel) * rank * panel + j * panel + c % panel

A kernel tile of a few rank rows by at most `panel` columns is then one
contiguous run (1.02-1.04x a layer against rows a full row width apart:
docs/benchmarks/kernels.md, session 18). `page_size` and every
segment offset are multiples of `align`, itself a multiple of `panel`, so a
chunk of `panel` elements (or of any divisor of it) that starts at a
multiple of its size never crosses a page: a kernel looks a page up once per
(row, chunk), not per element.

An adapter only stores the slices it targets; `seg_offsets` holds -1 for the
others. Element offset `o` of the stream lives in page `page_ids[o // page_size]`
at position `o % page_size`. Every layer stores its stream in its own pool
tensor under the same page ids (in the engine: one KV block id is one page in
every layer's KV tensor), so one page list per adapter serves all layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# A panel's columns: the widest column tile any kernel reads (the expand's
# output tile, the shrink's input chunk: kernels/triton_mbgmm.py).
PANEL = 128


@dataclass(frozen=True)
class SliceSpec:
    """One adapted linear map of a layer (a PEFT module such as q_proj)."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LayerLayout:
    """Segment geometry shared by every adapter of one model.

    `slices` fixes the global slice order g = 0..n-1; segment 2g is slice g's
    A, segment 2g+1 its Bt. Invariant: `page_size % align == 0`.
    """

    slices: tuple[SliceSpec, ...]
    page_size: int  # elements per page
    align: int = 256  # elements; row widths are padded to a multiple of this

    def __post_init__(self) -> None:
        if self.align <= 0 or self.page_size <= 0 or self.page_size % self.align:
            raise ValueError(f"page_size {self.page_size} must be a positive multiple of "
                             f"align {self.align}")
        if len({s.name for s in self.slices}) != len(self.slices):
            raise ValueError("slice names must be unique")

    @property
    def panel(self) -> int:
        """Columns of a panel (see the module's docstring): PANEL, or fewer
        where `align` is not a multiple of it (tests' small layouts)."""
        return math.gcd(self.align, PANEL)

    @property
    def num_segments(self) -> int:
        return 2 * len(self.slices)

    def width(self, segment: int) -> int:
        """Padded row width (elements) of a segment."""
        s = self.slices[segment // 2]
        return _round_up(s.out_features if segment % 2 else s.in_features, self.align)

    def slice_index(self, name: str) -> int:
        for g, s in enumerate(self.slices):
            if s.name == name:
                return g
        raise KeyError(f"no slice {name!r} in this layout")

    def weight_elements(self, placement: AdapterPlacement) -> int:
        """Elements of A and B one layer of this adapter holds (row padding
        excluded): what the kernels read of it per layer and step."""
        return sum(placement.rank * (s.in_features + s.out_features)
                   for g, s in enumerate(self.slices) if placement.seg_offsets[2 * g] >= 0)

    def place(self, rank: int, targets: Sequence[str]) -> AdapterPlacement:
        """Where each targeted segment of a rank-`rank` adapter starts."""
        if rank <= 0:
            raise ValueError(f"rank must be positive, got {rank}")
        present = {self.slice_index(t) for t in targets}
        offsets, cursor = [], 0
        for seg in range(self.num_segments):
            if seg // 2 in present:
                offsets.append(cursor)
                cursor += rank * self.width(seg)
            else:
                offsets.append(-1)
        return AdapterPlacement(rank, tuple(offsets), cursor, math.ceil(cursor / self.page_size))


@dataclass(frozen=True)
class AdapterPlacement:
    """One adapter's stream geometry (identical in every layer)."""

    rank: int
    seg_offsets: tuple[int, ...]  # element offset per segment, -1 if not targeted
    stream_len: int  # elements
    num_pages: int


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_shapes(name: str, s: SliceSpec, rank: int, a: Any, b: Any) -> None:
    """A [rank, in] and B [out, rank] of slice `s` (tensors, or where a file
    holds them: anything with a `shape`)."""
    if tuple(a.shape) != (rank, s.in_features) or tuple(b.shape) != (s.out_features, rank):
        raise ValueError(f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not "
                         f"match rank {rank}, in {s.in_features}, out {s.out_features}")


def pack_layer(
    layout: LayerLayout,
    placement: AdapterPlacement,
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's stream: `num_pages * page_size` elements, written into
    `out` when given (e.g. a row of a pinned host buffer), else into a new
    tensor on the weights' device. See `pack_layers`."""
    n = placement.num_pages * layout.page_size
    if out is not None and (out.shape != (n,) or out.dtype != dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a stream of {n} {dtype}")
    return pack_layers(layout, placement, [weights], scaling, dtype,
                       None if out is None else out.view(1, n))[0]


def pack_layers(
    layout: LayerLayout,
    placement: AdapterPlacement,
    layers: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    scaling: float,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every layer's stream ([len(layers), num_pages * page_size]), written
    into `out` when given, else into a new tensor on the weights' device.

    `layers[l]` maps slice name -> (A [rank, in], B [out, rank]) of layer l;
    scaling is folded into Bt. Padding, and slices a layer lacks, are zero.
    Each segment is written for all layers at once (a page load's launches
    do not grow with the model's depth), straight from the file's tensors.
    """
    n = placement.num_pages * layout.page_size
    shape = (len(layers), n)
    if out is None:
        first = next((ab for w in layers for ab in w.values()), None)
        out = torch.empty(shape, dtype=dtype,
                          device=first[0].device if first is not None else "cpu")
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not {len(layers)} streams "
                         f"of {n} {dtype}")
    r = placement.rank
    out.zero_()
    names = sorted({name for w in layers for name in w}, key=layout.slice_index)
    for name in names:
        g = layout.slice_index(name)
        s = layout.slices[g]
        have = [i for i, w in enumerate(layers) if name in w]
        for i in have:
            _check_shapes(name, s, r, *layers[i][name])
        for seg, pick in ((2 * g, 0), (2 * g + 1, 1)):
            off = placement.seg_offsets[seg]
            if off < 0:
                raise ValueError(f"slice {name} is not in this adapter's placement")
            # A layer without this slice contributes zeros (no index tensor:
            # building one on a GPU would make the host wait for it).
            like = layers[have[0]][name][pick]
            zeros = None if len(have) == len(layers) else like.new_zeros(like.shape)
            rows = torch.stack([layers[i][name][pick] if name in layers[i] else zeros
                                for i in range(len(layers))])
            # Bt = scaling * B^T, rounded to dtype once.
            write_segment(layout, out, off, seg, rows.transpose(1, 2) if pick else rows,
                          scaling if pick else None)
    return out


# One row of a pack table per (layer, segment) an adapter's file holds:
# the layer, where the tensor starts in the file's data (elements of the
# file's dtype), its columns in the segment (in or out features), whether it
# is a B (read transposed, times the scaling), and the segment's offset in
# the layer's stream. kernels/triton_pack.py writes a whole load from it.
PACK_COLUMNS = ("layer", "src", "cols", "is_b", "dst")


def pack_table(layout: LayerLayout, placement: AdapterPlacement,
               layers: Sequence[Mapping[str, tuple[Any, Any]]]) -> np.ndarray | None:
    """The pack table (PACK_COLUMNS, int64) of an adapter whose `layers[l]`
    maps slice name -> (A, B) where the file holds them (objects with
    `offset` in bytes, `shape` and a torch `dtype`, as adapters/peft.py's
    RawTensor). None where one launch cannot pack it: tensors of several
    dtypes, or an offset that is not a whole number of elements. Shapes are
    checked as `pack_layers` checks them."""
    r, rows = placement.rank, []
    dtypes = {t.dtype for w in layers for ab in w.values() for t in ab}
    if len(dtypes) != 1:
        return None
    size = next(iter(dtypes)).itemsize
    for la, w in enumerate(layers):
        for name, (a, b) in w.items():
            g = layout.slice_index(name)
            s = layout.slices[g]
            _check_shapes(name, s, r, a, b)
            for seg, t, cols in ((2 * g, a, s.in_features), (2 * g + 1, b, s.out_features)):
                if placement.seg_offsets[seg] < 0:
                    raise ValueError(f"slice {name} is not in this adapter's placement")
                if t.offset % size:
                    return None
                rows.append((la, t.offset // size, cols, seg % 2, placement.seg_offsets[seg]))
    return np.array(rows, dtype=np.int64).reshape(-1, len(PACK_COLUMNS))


def _panels(layout: LayerLayout, flat: torch.Tensor, rank: int, segment: int) -> torch.Tensor:
    """[..., rank, panels, panel] view of one segment's elements `flat`
    ([..., rank * width]): [..., j, p, i] is column p * panel + i of row j."""
    width, panel = layout.width(segment), layout.panel
    return flat.unflatten(-1, (width // panel, rank, panel)).transpose(-3, -2)


def write_segment(layout: LayerLayout, streams: torch.Tensor, offset: int, segment: int,
                  rows: torch.Tensor, scaling: float | None = None) -> None:
    """Write `rows` ([..., rank, in or out]; times `scaling` if given) into
    one segment of `streams` ([..., stream elements]), at `offset`, in
    panels. Padding columns are left as they are."""
    rank, cols, panel = rows.shape[-2], rows.shape[-1], layout.panel
    dst = _panels(layout, streams[..., offset:offset + rank * layout.width(segment)], rank,
                  segment)
    full = cols // panel
    # Whole panels, then the last one's columns: two copies, whatever the width.
    parts = [(dst[..., :full, :], rows[..., :full * panel].unflatten(-1, (full, panel)))]
    if cols > full * panel:
        parts.append((dst[..., full, :cols - full * panel], rows[..., full * panel:]))
    for d, src in parts:
        if scaling is None:
            d.copy_(src)
        else:
            torch.mul(src, scaling, out=d)


def warm_up_pack(layout: LayerLayout, dtype: torch.dtype, device: torch.device,
                 sources: Sequence[torch.dtype] = (torch.bfloat16, torch.float16,
                                                   torch.float32)) -> None:
    """Pack a small synthetic adapter once per file dtype in `sources` (two
    layers, the second without the last slice: both of `pack_layers`' paths),
    so that every kernel a page load launches on `device` has launched once
    (CUDA loads a kernel at its first launch; worker/paged_manager.py says
    why that matters)."""
    rank = 16  # >1: B's transposed rows take the strided copy a real load takes
    names = [s.name for s in layout.slices]
    placement = layout.place(rank, names)
    for src in sources:
        full = {s.name: (torch.zeros(rank, s.in_features, dtype=src, device=device),
                         torch.zeros(s.out_features, rank, dtype=src, device=device))
                for s in layout.slices}
        partial = {n: full[n] for n in names[:-1]} or full
        pack_layers(layout, placement, [full, partial], 1.0, dtype)


def write_pages(pool: torch.Tensor, page_ids: Sequence[int], stream: torch.Tensor,
                page_size: int) -> None:
    """Copy a packed stream into `pool` ([num_pages, page_size]) at `page_ids`."""
    if len(page_ids) * page_size != stream.numel():
        raise ValueError(f"{len(page_ids)} pages cannot hold {stream.numel()} elements")
    idx = torch.as_tensor(list(page_ids), dtype=torch.long, device=pool.device)
    pool[idx] = stream.view(len(page_ids), page_size).to(pool.device, pool.dtype)


def read_segment(
    layout: LayerLayout,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    rank: int,
    offset: int,
    segment: int,
) -> torch.Tensor:
    """Rows [rank, in or out] of one segment (padding cut off; a copy),
    gathered from `pool` ([num_pages, page_size]) through the adapter's
    `page_ids`."""
    n = rank * layout.width(segment)
    first, last = offset // layout.page_size, -(-(offset + n) // layout.page_size)
    chunk = pool[page_ids[first:last].long()].reshape(-1)
    start = offset - first * layout.page_size
    return segment_rows(layout, chunk, start, segment, rank)


def segment_rows(layout: LayerLayout, streams: torch.Tensor, offset: int, segment: int,
                 rank: int) -> torch.Tensor:
    """The inverse of `write_segment`: rows [..., rank, in or out] (padding
    cut off; a copy) of the segment at `offset` of `streams`."""
    width = layout.width(segment)
    flat = streams[..., offset:offset + rank * width]
    s = layout.slices[segment // 2]
    rows = _panels(layout, flat, rank, segment).flatten(-2)
    return rows[..., :(s.out_features if segment % 2 else s.in_features)]


def add_to_segment(
    layout: LayerLayout,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    offset: int,
    segment: int,
    rows: torch.Tensor,
) -> None:
    """The transpose of `read_segment`: add `rows` ([rank, in or out]) into
    one segment of `pool` ([num_pages, page_size]) in place (a gradient of
    the pool is laid out as the pool; padding stays as it was)."""
    rank, width = rows.shape[0], layout.width(segment)
    n = rank * width
    first, last = offset // layout.page_size, -(-(offset + n) // layout.page_size)
    chunk = torch.zeros((last - first) * layout.page_size, dtype=pool.dtype, device=pool.device)
    start = offset - first * layout.page_size
    write_segment(layout, chunk, start, segment, rows.to(pool.dtype))
    pool.index_add_(0, page_ids[first:last].long(), chunk.view(-1, layout.page_size))


def read_layer(
    layout: LayerLayout,
    placement: AdapterPlacement,
    pool: torch.Tensor,
    page_ids: Sequence[int],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of pack + write: slice name -> (A [rank, in], Bt [rank, out]),
    Bt with the scaling folded in."""
    ids = torch.as_tensor(list(page_ids), device=pool.device)
    out = {}
    for g, s in enumerate(layout.slices):
        a_off, b_off = placement.seg_offsets[2 * g], placement.seg_offsets[2 * g + 1]
        if a_off >= 0:
            out[s.name] = (read_segment(layout, pool, ids, placement.rank, a_off, 2 * g),
                           read_segment(layout, pool, ids, placement.rank, b_off, 2 * g + 1))
    return out
