"""Adapter residency in vLLM's KV block pool (S-LoRA §5, unified paging).

An adapter resident on the GPU holds `num_pages` KV block ids, taken from the
same `BlockPool` as every request's KV blocks: block id b is page b in every
layer's KV tensor (paging/layout.py), so one page list serves all layers.
Pages are taken with `get_new_blocks` (which evicts cached prefix blocks
first, as any KV allocation does) and held with ref_cnt 1, so vLLM never
hands them to a request; `free_blocks` returns them.

Invariants (tests/scheduler/test_pages.py):
- pages held == sum of len(blocks) over resident adapters; a block belongs
  to at most one adapter;
- an adapter with refs > 0 (a running or scheduled request uses it) is never
  evicted; idle adapters are evicted least recently used first;
- slots of resident adapters are distinct and below `max_slots`;
- `acquire` either succeeds or changes nothing (no eviction is wasted on an
  admission that cannot succeed);
- `load_ahead` never evicts and never leaves fewer than `reserve` blocks
  free: an adapter loaded ahead is idle (evictable) until a request acquires it;
- a removed adapter (`forget(..., removed=True)`) is not kept once idle:
  requests admitted before its removal may still make it resident, and its
  pages go with the last of them;
- a replaced adapter (`forget` after an in-place reload) takes no new
  request while its old version is in use: they get the new version, loaded
  once the old one's requests end (`replaced_in_use`);
- an admission never takes the request's own prefix-cache hits as its
  adapter's pages (`acquire`'s `hits`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_loraserve.paging.step import MAX_REMOVED_IDS, PageLoad, PoolStep


@dataclass
class Resident:
    lora_request: Any  # LoRARequest
    slot: int
    rank: int
    blocks: list[Any]  # KVCacheBlock
    refs: int = 0
    stale: bool = False  # removed or replaced: evict as soon as idle


@dataclass
class PoolStats:
    evictions: int = 0
    hits: int = 0  # acquires that found the adapter resident
    misses: int = 0  # acquires that had to load it
    ahead: int = 0  # loads for waiting requests, before their admission


@dataclass
class AdapterPages:
    """Pages and refs of resident adapters, over a vLLM `BlockPool`.

    `demand(lora_request) -> (rank, num_pages)` must be a pure function of
    the adapter (the scheduler caches it); it may raise for an adapter that
    cannot be served.
    """

    block_pool: Any
    demand: Callable[[Any], tuple[int, int]]
    max_slots: int
    resident: dict[int, Resident] = field(default_factory=dict)
    stats: PoolStats = field(default_factory=PoolStats)
    _idle: OrderedDict[int, None] = field(default_factory=OrderedDict)  # LRU first
    _holders: dict[str, int] = field(default_factory=dict)  # request id -> lora id
    _free_slots: list[int] = field(default_factory=list)
    _step: PoolStep = field(default_factory=PoolStep)
    _removed: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first

    def __post_init__(self) -> None:
        self._free_slots = list(range(self.max_slots - 1, -1, -1))

    # -- queries ----------------------------------------------------------
    @property
    def pages_held(self) -> int:
        return sum(len(r.blocks) for r in self.resident.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._holders

    def evictable_pages(self, keep: int | None = None) -> int:
        return sum(len(self.resident[i].blocks) for i in self._idle if i != keep)

    def removed(self, lora_id: int) -> bool:
        """Removed at runtime (one of the last MAX_REMOVED_IDS): only an
        admission loads it, never a load ahead."""
        return lora_id in self._removed

    def replaced_in_use(self, lora_id: int) -> bool:
        """Its resident pages hold a version replaced since (an in-place
        reload) that requests still use: the new version loads once they end."""
        r = self.resident.get(lora_id)
        return r is not None and r.stale and r.refs > 0 and lora_id not in self._removed

    # -- admission --------------------------------------------------------
    def acquire(self, request_id: str, lora_request: Any, hits: Sequence[Any] = ()) -> bool:
        """Make the request's adapter resident (evicting idle adapters if
        needed) and hold a ref for the request. False, with nothing changed,
        when it cannot be made resident now. `hits`: the request's prefix
        cache hits (KV blocks it will hold, free until then): never taken
        as its adapter's pages, which the request would read as its KV."""
        if request_id in self._holders:
            return True
        lora_id = lora_request.lora_int_id
        if self.replaced_in_use(lora_id):
            return False
        r = self.resident.get(lora_id)
        if r is not None and r.stale and r.refs == 0:
            self._evict(lora_id)
            r = None
        if r is not None:
            self.stats.hits += 1
        else:
            # Only taking pages can reach the hits: out of the free queue meanwhile.
            self.block_pool.touch(hits)
            try:
                r = self._load(lora_request)
            finally:
                self.block_pool.free_blocks(hits)
            if r is None:
                return False
        r.refs += 1
        self._idle.pop(lora_id, None)
        self._holders[request_id] = lora_id
        return True

    def _load(self, lora_request: Any) -> Resident | None:
        """Take pages and a slot for the adapter, evicting idle adapters as
        needed; None, with nothing changed, when they cannot be had."""
        lora_id = lora_request.lora_int_id
        rank, need = self.demand(lora_request)
        free = self.block_pool.get_num_free_blocks()
        slots_short = not self._free_slots
        if free + self.evictable_pages() < need or (slots_short and not self._idle):
            return None
        while self.block_pool.get_num_free_blocks() < need or not self._free_slots:
            self.evict_lru()
        r = Resident(lora_request, self._free_slots.pop(), rank,
                     self.block_pool.get_new_blocks(need),
                     stale=lora_id in self._removed)
        self.resident[lora_id] = r
        self._step.loads.append(PageLoad(r.slot, lora_request, rank,
                                         tuple(b.block_id for b in r.blocks)))
        self.stats.misses += 1
        return r

    def load_ahead(self, lora_request: Any, reserve: int) -> bool:
        """Make a waiting request's adapter resident now, idle, from free
        blocks only (no eviction), leaving at least `reserve` blocks free for
        KV; its admission then finds it resident (S-LoRA's prefetch). False,
        with nothing changed, when it is resident already or does not fit.
        Raises as `demand` does."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.resident or lora_id in self._removed:
            return False  # a removed one is loaded by its admission, to go after it
        rank, need = self.demand(lora_request)
        if not self._free_slots or self.block_pool.get_num_free_blocks() - need < reserve:
            return False
        r = Resident(lora_request, self._free_slots.pop(), rank,
                     self.block_pool.get_new_blocks(need))
        self.resident[lora_id] = r
        self._idle[lora_id] = None  # most recently used: evicted after older idle ones
        self._step.loads.append(PageLoad(r.slot, lora_request, rank,
                                         tuple(b.block_id for b in r.blocks), ahead=True))
        self.stats.ahead += 1
        return True

    def release(self, request_id: str) -> None:
        """Drop the request's ref (finished or preempted). Idempotent."""
        lora_id = self._holders.pop(request_id, None)
        if lora_id is None:
            return
        r = self.resident[lora_id]
        r.refs -= 1
        if r.refs == 0:
            if r.stale:
                self._evict(lora_id)
            else:
                self._idle[lora_id] = None  # most recently used: last

    # -- eviction ---------------------------------------------------------
    def evict_lru(self) -> bool:
        """Evict the least recently used idle adapter; False if none is idle."""
        if not self._idle:
            return False
        self._evict(next(iter(self._idle)))
        return True

    def evict_all_idle(self) -> int:
        n = 0
        while self.evict_lru():
            n += 1
        return n

    def forget(self, lora_id: int, removed: bool = False) -> None:
        """The adapter was removed (`removed`) or replaced: its pages go as
        soon as no request uses them; a removed one's also after requests
        admitted before the removal made it resident again."""
        if removed:  # ids are not reused: an in-place reload keeps a served one's
            self._removed[lora_id] = None
            while len(self._removed) > MAX_REMOVED_IDS:
                self._removed.popitem(last=False)
        r = self.resident.get(lora_id)
        if r is None:
            return
        if r.refs == 0:
            self._evict(lora_id)
        else:
            r.stale = True

    def _evict(self, lora_id: int) -> None:
        r = self.resident.pop(lora_id)
        assert r.refs == 0, f"adapter {lora_id} evicted while {r.refs} request(s) use it"
        self._idle.pop(lora_id, None)
        self.block_pool.free_blocks(r.blocks)
        self._free_slots.append(r.slot)
        # A load of this step into this slot is void: it never reaches a worker.
        self._step.loads = [ld for ld in self._step.loads if ld.slot != r.slot]
        self._step.evicted.append(r.slot)
        self.stats.evictions += 1

    # -- per step ---------------------------------------------------------
    def take_step(self) -> PoolStep:
        """The changes since the last call, for the workers."""
        step, self._step = self._step, PoolStep()
        return step
