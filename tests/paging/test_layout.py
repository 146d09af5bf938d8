"""Page layout: geometry invariants and pack/read round trips through
shuffled, non-contiguous pages with rows that straddle page boundaries."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.paging.layout import (
    LayerLayout,
    SliceSpec,
    pack_layer,
    pack_layers,
    read_layer,
    write_pages,
)

SLICES = (SliceSpec("q_proj", 48, 48), SliceSpec("k_proj", 48, 16), SliceSpec("v_proj", 48, 16),
          SliceSpec("down_proj", 80, 48))


def _weights(layout, rank, targets, seed=0):
    g = torch.Generator().manual_seed(seed)
    specs = {s.name: s for s in layout.slices}
    return {t: (torch.randn(rank, specs[t].in_features, generator=g),
                torch.randn(specs[t].out_features, rank, generator=g)) for t in targets}


def test_placement_geometry():
    layout = LayerLayout(SLICES, page_size=64, align=16)
    p = layout.place(5, ["q_proj", "down_proj"])
    widths = {seg: layout.width(seg) for seg in range(layout.num_segments)}
    assert widths[0] == 48 and widths[3] == 16 and widths[6] == 80
    assert p.seg_offsets == (0, 5 * 48, -1, -1, -1, -1, 5 * 96, 5 * 96 + 5 * 80)
    assert p.stream_len == 5 * (48 + 48 + 80 + 48)
    assert p.num_pages == math.ceil(p.stream_len / 64)


@pytest.mark.parametrize("align, panel", [(16, 16), (256, 128), (384, 128), (8, 8)])
def test_segments_stored_in_panels(align, panel):
    """Element (j, c) of a segment at `off` sits at off + (c // P) * rank * P
    + j * P + c % P: the address every kernel computes."""
    layout = LayerLayout((SliceSpec("q_proj", 300, 130),), page_size=4 * align, align=align)
    assert layout.panel == panel
    rank = 3
    a = torch.arange(rank * 300, dtype=torch.float32).view(rank, 300) + 1
    b = -torch.arange(130 * rank, dtype=torch.float32).view(130, rank) - 1
    p = layout.place(rank, ["q_proj"])
    stream = pack_layer(layout, p, {"q_proj": (a, b)}, 1.0, torch.float32)
    for seg, rows in ((0, a), (1, b.T)):
        off = p.seg_offsets[seg]
        for j in range(rank):
            for c in (0, 1, panel - 1, panel, 129, rows.shape[1] - 1):
                at = off + (c // panel) * rank * panel + j * panel + c % panel
                assert stream[at] == rows[j, c], (seg, j, c)
        # Padding columns of the last panel are zero.
        width = layout.width(seg)
        pad = off + (width // panel - 1) * rank * panel + panel - 1
        assert rows.shape[1] == width or stream[pad] == 0


def test_rows_padded_to_align():
    layout = LayerLayout((SliceSpec("q_proj", 50, 20),), page_size=128, align=32)
    assert (layout.width(0), layout.width(1)) == (64, 32)
    p = layout.place(3, ["q_proj"])
    assert p.seg_offsets == (0, 3 * 64) and p.stream_len == 3 * 96
    assert all(o % layout.align == 0 for o in p.seg_offsets)


@pytest.mark.parametrize("bad", [dict(page_size=100, align=16), dict(page_size=0, align=16)])
def test_page_size_must_be_multiple_of_align(bad):
    with pytest.raises(ValueError, match="multiple of align"):
        LayerLayout(SLICES, **bad)


def test_pack_checks_shapes():
    layout = LayerLayout(SLICES, page_size=64, align=16)
    p = layout.place(4, ["q_proj"])
    with pytest.raises(ValueError, match="do not match rank 4"):
        pack_layer(layout, p, {"q_proj": (torch.zeros(3, 48), torch.zeros(48, 3))}, 1.0,
                   torch.float32)
    with pytest.raises(ValueError, match="not in this adapter's placement"):
        pack_layer(layout, p, _weights(layout, 4, ["k_proj"]), 1.0, torch.float32)


def _round_trip(layout, rank, targets, scaling, dtype, seed):
    weights = _weights(layout, rank, targets, seed)
    placement = layout.place(rank, targets)
    rng = random.Random(seed)
    total = placement.num_pages + 7
    pool = torch.full((total, layout.page_size), 9.0, dtype=dtype)  # other data around
    page_ids = rng.sample(range(total), placement.num_pages)
    write_pages(pool, page_ids, pack_layer(layout, placement, weights, scaling, dtype),
                layout.page_size)
    back = read_layer(layout, placement, pool, page_ids)
    assert set(back) == set(targets)
    tol = 0 if dtype == torch.float32 else 2e-3
    for name, (a, b) in weights.items():
        a2, bt2 = back[name]
        torch.testing.assert_close(a2.float(), a.to(dtype).float(), atol=tol, rtol=tol)
        torch.testing.assert_close(bt2.float(), (b.T * scaling).to(dtype).float(),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_trip_shuffled_pages_straddling_rows(dtype):
    # 64-element pages hold one 48-wide row and a piece of the next one.
    _round_trip(LayerLayout(SLICES, page_size=64, align=16), 7,
                ["q_proj", "v_proj", "down_proj"], 0.5, dtype, seed=1)


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=4),
    rank=st.integers(1, 40),
    align=st.sampled_from([1, 8, 16, 32]),
    pages_per_align=st.integers(1, 6),
    data=st.data(),
)
def test_round_trip_property(dims, rank, align, pages_per_align, data):
    slices = tuple(SliceSpec(f"m{i}", i_, o) for i, (i_, o) in enumerate(dims))
    layout = LayerLayout(slices, page_size=align * pages_per_align, align=align)
    targets = data.draw(st.lists(st.sampled_from([s.name for s in slices]), min_size=1,
                                 unique=True))
    _round_trip(layout, rank, targets, data.draw(st.floats(0.1, 4.0)), torch.float32,
                seed=data.draw(st.integers(0, 1000)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_layers_writes_each_layer_and_zeroes_what_a_layer_lacks(dtype):
    """All layers packed at once (a page load) read back layer by layer; a
    slice one layer lacks (PEFT's layers_to_transform) reads back as zero."""
    layout = LayerLayout(SLICES, page_size=64, align=16)
    targets = ["q_proj", "v_proj", "down_proj"]
    layers = [_weights(layout, 5, targets, seed=i) for i in range(3)]
    del layers[1]["v_proj"]
    placement = layout.place(5, targets)
    # Written into a buffer of NaN: padding and the missing slice must be set.
    out = torch.full((3, placement.num_pages * layout.page_size), float("nan"), dtype=dtype)
    streams = pack_layers(layout, placement, layers, 0.25, dtype, out=out)
    assert streams.data_ptr() == out.data_ptr()
    assert not streams.isnan().any()
    assert not streams[:, placement.stream_len:].any()  # the last page's tail
    page_ids = random.Random(0).sample(range(placement.num_pages + 3), placement.num_pages)
    tol = 0 if dtype == torch.float32 else 1e-2
    for stream, weights in zip(streams, layers, strict=True):
        pool = torch.full((placement.num_pages + 3, layout.page_size), 9.0, dtype=dtype)
        write_pages(pool, page_ids, stream, layout.page_size)
        back = read_layer(layout, placement, pool, page_ids)
        for name in targets:
            a, b = weights.get(name, (torch.zeros(5, 48), torch.zeros(16, 5)))
            torch.testing.assert_close(back[name][0].float(), a.to(dtype).float(),
                                       atol=tol, rtol=tol)
            torch.testing.assert_close(back[name][1].float(), (b.T * 0.25).to(dtype).float(),
                                       atol=tol, rtol=tol)
