"""The host tier's memory: one arena, allocated (and pinned) once at start-up.

Pinning host memory while serving stalls the engine: on an H200 the host
tier's readers pinned each new adapter buffer (`cudaHostRegister`, 15.5 ms a
call) and the engine thread's kernel launches took 163 us instead of ~13 us
meanwhile (docs/benchmarks/e2e.md; benchmarks/e2e/pin_contention.py). So the
tier's bytes are all allocated before the server reports ready, and a read
takes a sub-allocation (`Extent`) of them.

The arena is `count` chunks of `chunk_bytes` each, pinned on a CUDA machine
(`torch.empty(pin_memory=True)`, under the allocator settings of
plugin.PINNED_ALLOC_CONF), plain memory otherwise, so the CPU suite runs the
same allocator. An extent is one contiguous, `align`-aligned byte range
within one chunk: an adapter's file data is one buffer (one `readinto`, one
host-to-device copy). Each chunk keeps a free list of holes, sorted by
offset, neighbours coalesced; `alloc` takes the smallest hole that fits
(best fit: large holes stay whole for large adapters).

`make_chunk` replaces how a chunk's bytes are made: worker/cpu_lora/shm.py
`SharedChunks` puts each in a shared-memory segment (pinned on CUDA), so
the CPU LoRA workers read adapters where the tier keeps them.

Chunks are powers of two: torch's pinned allocator rounds each block up to
one, so any other size would pin memory the arena cannot use. A chunk holds
the largest adapter the pool can serve (`for_budget`), so any servable
adapter fits an empty chunk.

Invariants (`check`): extents and holes do not overlap and tile every chunk;
`used` == the sum of the live extents' sizes; `used` + free bytes == `size`;
holes are never adjacent (freed neighbours are merged).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

ALIGN = 4096  # page-aligned extents: any dtype's view of an extent is aligned
CHUNK_BYTES = 256 << 20


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True)
class Extent:
    chunk: int
    offset: int
    size: int  # bytes reserved: the request rounded up to the arena's alignment


class PinnedArena:
    def __init__(self, chunk_bytes: int, count: int, pinned: bool, align: int = ALIGN,
                 make_chunk: Callable[[int], torch.Tensor] | None = None) -> None:
        if chunk_bytes % align or chunk_bytes <= 0 or count < 1:
            raise ValueError(f"chunks of {chunk_bytes} bytes (x{count}) are not whole "
                             f"multiples of the {align}-byte alignment")
        self.chunk_bytes, self.align, self.pinned = chunk_bytes, align, pinned
        # Freed only with the arena (at shutdown): nothing is pinned later.
        make = make_chunk or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
        self.chunks = [make(chunk_bytes) for _ in range(count)]
        self._holes: list[list[tuple[int, int]]] = [[(0, chunk_bytes)] for _ in range(count)]
        self._live: set[Extent] = set()
        self.used = 0

    @classmethod
    def for_budget(cls, budget: int, largest: int, pinned: bool,
                   chunk_bytes: int = CHUNK_BYTES,
                   make_chunk: Callable[[int], torch.Tensor] | None = None) -> PinnedArena:
        """The arena for a byte budget, where no adapter takes more than
        `largest` bytes: chunks of `chunk_bytes` (or the budget, if smaller,
        rounded down to a power of two), grown to the smallest power of two
        that holds `largest`; as many whole chunks as the budget holds, and
        at least one, so the largest adapter can always be read."""
        chunk = max(_pow2_ceil(max(largest, ALIGN)),
                    _pow2_floor(max(min(chunk_bytes, budget), ALIGN)))
        return cls(chunk, max(1, budget // chunk), pinned, make_chunk=make_chunk)

    @property
    def size(self) -> int:
        return self.chunk_bytes * len(self.chunks)

    def round(self, nbytes: int) -> int:
        """The size of an extent for `nbytes` (at least one alignment unit)."""
        return max(1, -(-nbytes // self.align)) * self.align

    def alloc(self, nbytes: int) -> Extent | None:
        """A free extent of at least `nbytes`, or None if no hole fits."""
        size = self.round(nbytes)
        best: tuple[int, int, int] | None = None  # (hole size, chunk, index)
        for c, holes in enumerate(self._holes):
            for i, (_, hole) in enumerate(holes):
                if size <= hole and (best is None or hole < best[0]):
                    best = (hole, c, i)
        if best is None:
            return None
        hole, c, i = best
        offset = self._holes[c][i][0]
        if hole == size:
            del self._holes[c][i]
        else:
            self._holes[c][i] = (offset + size, hole - size)
        extent = Extent(c, offset, size)
        self._live.add(extent)
        self.used += size
        return extent

    def free(self, extent: Extent) -> None:
        if extent not in self._live:
            raise ValueError(f"{extent} is not allocated from this arena")
        self._live.remove(extent)
        self.used -= extent.size
        holes = self._holes[extent.chunk]
        i = bisect.bisect(holes, (extent.offset, 0))
        start, size = extent.offset, extent.size
        if i < len(holes) and holes[i][0] == start + size:  # merge the next hole
            size += holes.pop(i)[1]
        if i > 0 and sum(holes[i - 1]) == start:  # and the previous one
            start, size = holes[i - 1][0], holes[i - 1][1] + size
            i -= 1
            holes.pop(i)
        holes.insert(i, (start, size))

    def view(self, extent: Extent, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of `extent`, as a uint8 tensor."""
        if nbytes > extent.size:
            raise ValueError(f"{nbytes} bytes do not fit {extent}")
        return self.chunks[extent.chunk][extent.offset:extent.offset + nbytes]

    def largest_hole(self) -> int:
        return max((size for holes in self._holes for _, size in holes), default=0)

    def check(self) -> None:
        """Assert the invariants (for tests)."""
        assert self.used == sum(e.size for e in self._live)
        assert self.used + sum(s for holes in self._holes for _, s in holes) == self.size
        for c, holes in enumerate(self._holes):
            spans = sorted([(o, s, "hole") for o, s in holes]
                           + [(e.offset, e.size, "live") for e in self._live if e.chunk == c])
            at = 0
            for (offset, size, kind), nxt in zip(spans, spans[1:] + [None], strict=True):
                assert offset == at and size > 0 and offset % self.align == 0, (c, spans)
                assert not (kind == "hole" and nxt is not None and nxt[2] == "hole"), (c, spans)
                at = offset + size
            assert at == self.chunk_bytes, (c, spans)
