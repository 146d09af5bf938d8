"""The pool's host tier: byte budget and LRU order."""

from __future__ import annotations

import torch

from vllm_loraserve.worker.host_cache import HostAdapter, HostCache


def entry(nbytes: int) -> HostAdapter:
    return HostAdapter("a", placement=None, streams=torch.zeros(1, nbytes, dtype=torch.uint8))


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
