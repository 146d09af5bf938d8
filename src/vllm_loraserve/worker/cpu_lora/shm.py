"""Host memory that the engine and its CPU workers map at once.

A `SharedSegment` is an anonymous shared-memory file (memfd_create), mapped
by the process that creates it and, through its file descriptor (inherited
with `pass_fds`), by the workers: a tensor written by one is read by the
others with no copy and no pickling. On a CUDA machine the owner can pin it
(`pin`: cudaHostRegister, portable and mapped), so the GPU copies to and
from it asynchronously and reads its flags from a kernel.

It has no name in /dev/shm: its memory goes when the last process that maps
it or holds its descriptor goes, so nothing outlives a crash, and the owner
can hand the same segment to workers started later.
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections.abc import Sequence

import torch

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class SharedSegment:
    def __init__(self, fd: int, size: int, owner: bool) -> None:
        if size <= 0:
            raise ValueError(f"a shared segment needs a positive size, got {size}")
        self.size, self.owner = size, owner
        if not owner and os.fstat(fd).st_size < size:
            raise ValueError(f"shared segment fd {fd} holds {os.fstat(fd).st_size} bytes, "
                             f"not {size}")
        self._mmap = mmap.mmap(fd, size)
        self.fd = fd if owner else -1  # a worker needs no descriptor once mapped
        if not owner:
            os.close(fd)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.address = self.bytes.data_ptr()
        self.pinned = False

    @classmethod
    def create(cls, size: int, tag: str) -> SharedSegment:
        """A new zero-filled segment (`tag` names it in /proc/<pid>/fd)."""
        fd = os.memfd_create(f"loraserve-{tag}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedSegment:
        """Map the segment behind an inherited descriptor (which it closes)."""
        return cls(fd, size, owner=False)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) as a uint8 tensor."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside a segment of "
                             f"{self.size} bytes")
        return self.bytes[offset:offset + nbytes]

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.size

    def pin(self) -> None:
        """Page-lock it for the current CUDA context, mapped for kernels."""
        if self.pinned:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(self.address, self.size,
                                                        _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err:
            raise RuntimeError(f"cudaHostRegister of a shared segment ({self.size} bytes) "
                               f"failed with cudaError {err}")
        self.pinned = True

    def close(self) -> None:
        """Unpin, close the descriptor and drop this object's mapping
        (idempotent). The memory is unmapped when the last view of it goes:
        torch's views hold the mmap object, never a raw pointer into it, so
        no view ever outlives the mapping (an explicit mmap.close() would
        leave them dangling: torch does not hold a buffer export)."""
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.address)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.bytes = self._mmap = None


class SegmentIndex:
    """Which of `segments` (which never overlap) holds a range of addresses:
    one bisect over their start addresses."""

    def __init__(self, segments: Sequence[SharedSegment]) -> None:
        self.segments = list(segments)
        self._by_address = sorted((s.address, i) for i, s in enumerate(self.segments))
        self._starts = [a for a, _ in self._by_address]

    def find(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(the segment's position in `segments`, the offset in it) of bytes
        [address, address + nbytes), if one segment holds them all."""
        j = bisect.bisect_right(self._starts, address) - 1
        if j < 0:
            return None
        i = self._by_address[j][1]
        if not self.segments[i].contains(address, nbytes):
            return None
        return i, address - self.segments[i].address


class SharedChunks:
    """A PinnedArena's chunk allocator (`PinnedArena(..., make_chunk=)`) that
    puts each chunk in its own segment, so CPU workers read adapter weights
    where the host tier keeps them (no copy). The chunks are pinned on a
    CUDA machine, as the arena's own chunks are."""

    def __init__(self, pinned: bool, tag: str = "arena") -> None:
        self.pinned, self.tag = pinned, tag
        self.segments: list[SharedSegment] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        segment = SharedSegment.create(nbytes, f"{self.tag}-{len(self.segments)}")
        if self.pinned:
            segment.pin()
        self.segments.append(segment)
        return segment.bytes

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        self.segments = []
