"""The pool's host tier: adapters in host memory, as their files hold them.

Each entry is one adapter's weights file data in one buffer (read with one
copy, adapters/peft.py `read_weights`), pinned when a CUDA device will copy
from it, so a device load is one host-to-device copy and never touches the
disk; the packing into page layout runs on the device (worker/paged_manager.py).
Entries are evicted least recently used first to stay within a byte budget;
an evicted adapter is read from disk again when it is next needed.

Entries the scheduler still needs (`keep`: adapters of waiting requests not
yet in the device pool) go last: evicting one of them means reading it again
before its requests can run, which is what made read-ahead churn the tier.
Read-ahead therefore starts only when `has_room` says the kept entries and
the reads under way leave room for it.

Sizes are what the memory costs: torch's pinned allocator rounds each block
up to a power of two (and caches freed blocks for reuse), so a pinned entry
counts at that size.

Invariant: `bytes_used` == sum of the entries' sizes <= `budget`, except
that a single entry larger than the budget is still admitted (alone), so
any adapter can be served.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from vllm_loraserve.adapters.peft import RawWeights
from vllm_loraserve.paging.layout import AdapterPlacement


def allocation_bytes(nbytes: int, pinned: bool) -> int:
    """Host memory an `nbytes` buffer takes (torch's pinned allocator rounds
    each block up to a power of two)."""
    return 1 << max(0, nbytes - 1).bit_length() if pinned else nbytes


@dataclass(frozen=True)
class HostAdapter:
    name: str
    placement: AdapterPlacement
    scaling: float
    weights: RawWeights
    where: dict[str, tuple[int, str]]  # module path -> (layer, slice name), checked on read
    # Set once, on the reader's thread: `is_pinned` asks the CUDA driver, which
    # waits behind other threads' pinning (5 ms a call in the e2e profile), and
    # the engine thread sums sizes at every prefetch decision.
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        data = self.weights.data
        object.__setattr__(self, "nbytes", allocation_bytes(
            data.numel() * data.element_size(), data.is_pinned()))


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

    def kept_bytes(self, keep: Collection[int]) -> int:
        return sum(e.nbytes for i, e in self._entries.items() if i in keep)

    def has_room(self, nbytes: int, keep: Collection[int], reserved: int = 0) -> bool:
        """Whether an entry of `nbytes` fits beside the kept entries and
        `reserved` bytes of reads under way (evicting only entries not kept).
        An empty tier always has room, so an oversized adapter can be read."""
        kept = self.kept_bytes(keep)
        return kept + reserved + nbytes <= self.budget or kept + reserved == 0

    def put(self, lora_id: int, entry: HostAdapter, keep: Collection[int] = ()) -> list[int]:
        """Insert (or replace) an entry; returns the ids evicted for room:
        least recently used first, entries in `keep` only if the others do
        not make room."""
        self.pop(lora_id)
        evicted = []
        for spare_kept in (True, False):
            for old in list(self._entries):
                if self.bytes_used + entry.nbytes <= self.budget:
                    break
                if spare_kept and old in keep:
                    continue
                self.bytes_used -= self._entries.pop(old).nbytes
                evicted.append(old)
        self._entries[lora_id] = entry
        self.bytes_used += entry.nbytes
        return evicted

    def pop(self, lora_id: int) -> HostAdapter | None:
        entry = self._entries.pop(lora_id, None)
        if entry is not None:
            self.bytes_used -= entry.nbytes
        return entry
