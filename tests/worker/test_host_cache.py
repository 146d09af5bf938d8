"""The pool's host tier: byte budget and LRU order."""

from __future__ import annotations

import torch

from vllm_loraserve.adapters.peft import RawWeights
from vllm_loraserve.worker.host_cache import HostAdapter, HostCache, allocation_bytes


def entry(nbytes: int) -> HostAdapter:
    return HostAdapter("a", placement=None, scaling=1.0,
                       weights=RawWeights(torch.zeros(nbytes, dtype=torch.uint8), {}), where={})


def test_lru_within_the_budget():
    c = HostCache(budget=300)
    for i in range(3):
        assert c.put(i, entry(100)) == []
    c.get(0)  # 1 is now the least recently used
    assert c.put(3, entry(100)) == [1]
    assert sorted(c.ids()) == [0, 2, 3] and c.bytes_used == 300
    assert c.put(4, entry(150)) == [2, 0]
    assert sorted(c.ids()) == [3, 4] and c.bytes_used == 250 <= c.budget


def test_an_entry_larger_than_the_budget_is_kept_alone():
    c = HostCache(budget=100)
    c.put(0, entry(50))
    assert c.put(1, entry(500)) == [0]
    assert c.ids() == [1] and c.bytes_used == 500
    assert c.pop(1) is not None and c.bytes_used == 0


def test_kept_entries_go_last():
    c = HostCache(budget=300)
    for i in range(3):
        c.put(i, entry(100))
    # 0 and 1 are older, but waiting requests still need 0: 1 and 2 go first.
    assert c.put(3, entry(200), keep={0}) == [1, 2]
    assert sorted(c.ids()) == [0, 3]
    # Only kept entries left to evict: an entry that must be stored still is.
    assert c.put(4, entry(250), keep={0, 3}) == [0, 3]
    assert c.ids() == [4] and c.bytes_used == 250


def test_room_for_read_ahead_counts_kept_entries_and_reads_under_way():
    c = HostCache(budget=300)
    c.put(0, entry(100))
    c.put(1, entry(100))
    assert c.has_room(100, keep={0})  # 1 can make room
    assert c.has_room(200, keep={0})
    assert not c.has_room(200, keep={0, 1})
    assert not c.has_room(100, keep={0}, reserved=150)
    # An empty tier with nothing under way admits an oversized adapter.
    assert HostCache(budget=100).has_room(500, keep=())
    assert not HostCache(budget=100).has_room(500, keep=(), reserved=10)


def test_pinned_sizes_count_as_the_allocator_rounds_them():
    assert allocation_bytes(100 << 20, pinned=False) == 100 << 20
    assert allocation_bytes(100 << 20, pinned=True) == 128 << 20
    assert allocation_bytes(128 << 20, pinned=True) == 128 << 20


def test_sizes_are_taken_once_when_read(monkeypatch):
    """Budget sums run on the engine thread at every prefetch decision; they
    must not ask the CUDA driver (`is_pinned`) again for each entry."""
    entries = [entry(100) for _ in range(3)]

    def driver_call(self):
        raise AssertionError("is_pinned called after the read")

    monkeypatch.setattr(torch.Tensor, "is_pinned", driver_call)
    c = HostCache(budget=250)
    assert c.put(0, entries[0]) == [] and c.put(1, entries[1]) == []
    assert c.has_room(50, keep={0, 1}) and not c.has_room(51, keep={0, 1})
    assert c.put(2, entries[2], keep={1}) == [0] and c.bytes_used == 200
