"""Shared segments: one set of bytes in every process that maps them, no
file in /dev/shm at any time; an arena whose chunks are segments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_loraserve.worker.arena import PinnedArena
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks, SharedSegment


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_another_process_sees_and_writes_the_same_bytes():
    seg = SharedSegment.create(1 << 16, "test")
    try:
        seg.view(100, 8).copy_(torch.arange(8, dtype=torch.uint8))
        code = (f"from vllm_loraserve.worker.cpu_lora.shm import SharedSegment as S\n"
                f"s = S.attach({seg.fd}, {seg.size})\n"
                f"assert s.view(100, 8).tolist() == list(range(8))\n"
                f"s.view(200, 1).fill_(42)\n")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                       pass_fds=(seg.fd,))
        assert seg.view(200, 1).item() == 42
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("loraserve")]
    finally:
        fd = seg.fd
        seg.close()
    assert not _fd_open(fd)
    seg.close()  # idempotent


def test_views_are_checked_and_survive_close():
    seg = SharedSegment.create(4096, "test")
    view = seg.view(0, 16)
    with pytest.raises(ValueError):
        seg.view(4090, 16)
    seg.close()
    view.fill_(7)  # still mapped while a view holds it
    assert view.sum().item() == 7 * 16


def test_an_arena_in_shared_chunks():
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena.for_budget(3 << 20, largest=1 << 20, pinned=False, chunk_bytes=1 << 20,
                                   make_chunk=chunks)
    assert len(arena.chunks) == len(chunks.segments) == 3
    extent = arena.alloc(5000)
    arena.view(extent, 5000).fill_(3)
    seg = chunks.segments[extent.chunk]
    assert seg.view(extent.offset, 5000).sum().item() == 3 * 5000
    assert seg.contains(arena.view(extent, 10).data_ptr(), 10)
    arena.check()
    fds = [s.fd for s in chunks.segments]
    chunks.close()
    assert not any(_fd_open(fd) for fd in fds)
