"""The host tier's arena: chunk sizing, extents, free lists."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.worker.arena import ALIGN, PinnedArena


def test_chunks_hold_the_largest_adapter_and_fill_the_budget():
    a = PinnedArena.for_budget(32 << 30, largest=1300 << 20, pinned=False)
    assert (a.chunk_bytes, len(a.chunks)) == (2 << 30, 16)  # a power of two >= 1300 MiB
    a = PinnedArena.for_budget(1 << 30, largest=3 << 20, pinned=False)
    assert (a.chunk_bytes, len(a.chunks)) == (256 << 20, 4)
    # A budget smaller than a chunk: one chunk of the budget (rounded down) ...
    a = PinnedArena.for_budget(5 << 20, largest=1 << 20, pinned=False)
    assert (a.chunk_bytes, len(a.chunks)) == (4 << 20, 1)
    # ... unless the largest adapter needs more: one chunk that holds it.
    a = PinnedArena.for_budget(4 << 20, largest=5 << 20, pinned=False)
    assert (a.chunk_bytes, len(a.chunks)) == (8 << 20, 1)
    assert not a.chunks[0].is_pinned()


def test_extents_are_aligned_ranges_within_one_chunk():
    a = PinnedArena(4 * ALIGN, 2, pinned=False)
    e = a.alloc(ALIGN + 1)
    assert (e.offset % ALIGN, e.size) == (0, 2 * ALIGN)
    view = a.view(e, ALIGN + 1)
    assert view.numel() == ALIGN + 1
    assert view.data_ptr() == a.chunks[e.chunk].data_ptr() + e.offset
    # 3 pages do not fit the 2 left in e's chunk: the other chunk, whole.
    f = a.alloc(3 * ALIGN)
    assert f.chunk != e.chunk and f.offset == 0
    assert a.alloc(4 * ALIGN) is None  # no chunk has 4 contiguous free pages
    assert a.used == 5 * ALIGN
    a.check()


def test_best_fit_and_freed_neighbours_merge():
    a = PinnedArena(8 * ALIGN, 1, pinned=False)
    x, y, z, w = (a.alloc(ALIGN) for _ in range(4))
    a.free(y)  # hole of 1 page between x and z; 4 pages free after w
    assert a.alloc(ALIGN) == y  # the smallest hole that fits
    a.free(y)
    a.free(x)  # merges with y's hole
    a.free(w)  # merges with the tail
    a.check()
    assert a.alloc(6 * ALIGN) is None  # z splits the free pages 2 + 5
    a.free(z)
    assert a.largest_hole() == 8 * ALIGN and a.used == 0
    assert a.alloc(8 * ALIGN).offset == 0


def test_an_extent_is_freed_once():
    a = PinnedArena(ALIGN, 1, pinned=False)
    e = a.alloc(10)
    a.free(e)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(e)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN), st.integers(0, 63)),
                max_size=80))
def test_random_churn_keeps_the_invariants(ops):
    """used == the live extents' sizes, used + free == size, no overlap,
    holes merged; an allocation fails only when no hole fits it; data written
    to one extent never shows in another."""
    a = PinnedArena(8 * ALIGN, 3, pinned=False)
    live = []
    for n, (alloc, nbytes, pick) in enumerate(ops):
        if alloc or not live:
            e = a.alloc(nbytes)
            if e is None:
                assert a.largest_hole() < a.round(nbytes)
            else:
                assert e.size == a.round(nbytes) >= nbytes
                a.view(e, e.size).fill_(n % 256)
                live.append((e, n % 256))
        else:
            e, _ = live.pop(pick % len(live))
            a.free(e)
        a.check()
        assert a.used == sum(e.size for e, _ in live)
        for e, mark in live:
            assert bool((a.view(e, e.size) == mark).all())
