"""The pool's host tier: adapters in host memory, already in page layout.

Each entry is one adapter's page streams for every layer ([layers, pages *
page_size], paging/layout.py), pinned when a CUDA device will copy from it,
so a device load is one page copy per layer and never touches the disk.
Entries are evicted least recently used first to stay within a byte budget;
an evicted adapter is read from disk again when it is next needed.

Invariant: `bytes_used` == sum of the entries' sizes <= `budget`, except
that a single entry larger than the budget is still admitted (alone), so
any adapter can be served.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from vllm_loraserve.paging.layout import AdapterPlacement


@dataclass(frozen=True)
class HostAdapter:
    name: str
    placement: AdapterPlacement
    streams: torch.Tensor  # [num_layers, num_pages * page_size]

    @property
    def nbytes(self) -> int:
        return self.streams.numel() * self.streams.element_size()


class HostCache:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes_used = 0
        self._entries: OrderedDict[int, HostAdapter] = OrderedDict()  # LRU first

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._entries

    def ids(self) -> list[int]:
        return list(self._entries)

    def get(self, lora_id: int) -> HostAdapter | None:
        entry = self._entries.get(lora_id)
        if entry is not None:
            self._entries.move_to_end(lora_id)
        return entry

    def put(self, lora_id: int, entry: HostAdapter) -> list[int]:
        """Insert (or replace) an entry; returns the ids evicted for room."""
        self.pop(lora_id)
        evicted = []
        while self._entries and self.bytes_used + entry.nbytes > self.budget:
            old, dropped = self._entries.popitem(last=False)
            self.bytes_used -= dropped.nbytes
            evicted.append(old)
        self._entries[lora_id] = entry
        self.bytes_used += entry.nbytes
        return evicted

    def pop(self, lora_id: int) -> HostAdapter | None:
        entry = self._entries.pop(lora_id, None)
        if entry is not None:
            self.bytes_used -= entry.nbytes
        return entry
