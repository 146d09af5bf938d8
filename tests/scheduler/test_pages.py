"""AdapterPages over vLLM's real BlockPool: page accounting, refs, LRU eviction."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.core.block_pool import BlockPool

from vllm_loraserve.scheduler.pages import AdapterPages

PAGES = {1: 3, 2: 5, 3: 9, 4: 17, 5: 34}  # lora id -> pages needed


def lr(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def make(num_blocks: int = 64, max_slots: int = 16) -> AdapterPages:
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    return AdapterPages(pool, lambda r: (8, PAGES[r.lora_int_id]), max_slots)


def check_invariants(ap: AdapterPages) -> None:
    ids = [b.block_id for r in ap.resident.values() for b in r.blocks]
    assert len(ids) == len(set(ids)) == ap.pages_held
    assert all(ap.block_pool.blocks[i].ref_cnt == 1 for i in ids)
    assert ap.block_pool.get_num_free_blocks() == ap.block_pool.num_gpu_blocks - 1 - len(ids)
    slots = [r.slot for r in ap.resident.values()]
    assert len(slots) == len(set(slots)) and all(0 <= s < ap.max_slots for s in slots)
    holders: dict[int, int] = {}
    for lora_id in ap._holders.values():
        holders[lora_id] = holders.get(lora_id, 0) + 1
    for lora_id, r in ap.resident.items():
        assert r.refs == holders.get(lora_id, 0)
        assert (lora_id in ap._idle) == (r.refs == 0)


def test_acquire_loads_once_and_reports_one_page_load():
    ap = make()
    assert ap.acquire("r1", lr(2)) and ap.acquire("r2", lr(2))
    step = ap.take_step()
    assert [(ld.slot, ld.lora_request.lora_int_id, len(ld.page_ids)) for ld in step.loads] == [
        (0, 2, 5)]
    assert ap.resident[2].refs == 2 and ap.stats.misses == 1 and ap.stats.hits == 1
    assert not ap.take_step()
    check_invariants(ap)


def test_adapters_in_use_are_never_evicted():
    ap = make(num_blocks=1 + 34 + 5)
    assert ap.acquire("r1", lr(5))  # 34 pages, in use
    assert ap.acquire("r2", lr(2))  # the 5 pages left
    assert not ap.acquire("r3", lr(1))  # nothing idle to evict
    assert not ap.evict_lru() and set(ap.resident) == {5, 2}
    check_invariants(ap)


def test_failed_acquire_changes_nothing():
    ap = make(num_blocks=40)
    assert ap.acquire("r1", lr(5))  # 34 of 39 pages, in use
    assert ap.acquire("r2", lr(1))
    ap.release("r2")  # a1 idle (3 pages), 2 free
    before = (set(ap.resident), ap.block_pool.get_num_free_blocks())
    assert not ap.acquire("r3", lr(3))  # needs 9: 2 free + 3 evictable is not enough
    assert (set(ap.resident), ap.block_pool.get_num_free_blocks()) == before
    assert ap.stats.evictions == 0
    check_invariants(ap)


def test_idle_adapters_are_evicted_least_recently_used_first():
    ap = make(num_blocks=1 + 3 + 5 + 9 + 4)
    for i, req in ((1, "r1"), (2, "r2"), (3, "r3")):
        assert ap.acquire(req, lr(i))
    ap.release("r2")
    ap.release("r1")
    ap.release("r3")  # idle order, oldest first: a2, a1, a3
    ap.take_step()
    assert ap.acquire("r4", lr(4))  # 17 pages: 4 free, evicts a2 (5) then a1 (3) then a3 (9)
    assert set(ap.resident) == {4}
    step = ap.take_step()
    assert step.evicted == [1, 0, 2]  # slots of a2, a1, a3 in LRU order
    check_invariants(ap)


def test_lru_keeps_the_recently_used_adapter():
    ap = make(num_blocks=1 + 3 + 5 + 9)
    for i, req in ((1, "r1"), (2, "r2"), (3, "r3")):
        assert ap.acquire(req, lr(i))
    for req in ("r1", "r2", "r3"):
        ap.release(req)
    assert ap.acquire("r1b", lr(1))  # a1 used again: now most recent
    ap.release("r1b")
    assert ap.acquire("r5", lr(2))  # resident already: a hit, nothing evicted
    assert ap.stats.evictions == 0
    ap.release("r5")
    ap.forget(3)  # removed at runtime: goes at once (idle)
    assert 3 not in ap.resident
    check_invariants(ap)


def test_forget_while_in_use_evicts_on_last_release():
    ap = make()
    assert ap.acquire("r1", lr(2))
    ap.forget(2)
    assert 2 in ap.resident  # still used
    ap.release("r1")
    assert 2 not in ap.resident and ap.take_step().evicted == [0]


def test_a_removed_adapter_made_resident_again_goes_after_its_last_request():
    """A request admitted before the runtime remove makes the adapter
    resident again: its pages go when that request ends, and nothing loads
    it ahead meanwhile."""
    ap = make()
    ap.forget(2, removed=True)  # not resident when removed
    assert not ap.load_ahead(lr(2), reserve=0) and 2 not in ap.resident
    assert ap.acquire("late", lr(2)) and 2 in ap.resident
    ap.take_step()
    ap.release("late")
    assert 2 not in ap.resident and ap.take_step().evicted == [0]
    ap.forget(3)  # a replaced (reloaded in place) adapter stays cacheable
    assert ap.acquire("r3", lr(3))
    ap.release("r3")
    assert 3 in ap.resident
    check_invariants(ap)


def test_a_load_evicted_in_the_same_step_never_reaches_the_workers():
    ap = make(num_blocks=1 + 34)
    assert ap.acquire("r1", lr(5))
    ap.release("r1")
    assert ap.acquire("r2", lr(4))  # evicts a5 before its load was sent
    step = ap.take_step()
    assert [ld.lora_request.lora_int_id for ld in step.loads] == [4]
    assert step.evicted == [0] and step.loads[0].slot == 0


def test_slots_are_bounded():
    ap = make(max_slots=2)
    assert ap.acquire("r1", lr(1)) and ap.acquire("r2", lr(2))
    assert not ap.acquire("r3", lr(3))  # no idle adapter to give its slot
    ap.release("r1")
    assert ap.acquire("r3", lr(3)) and 1 not in ap.resident
    check_invariants(ap)


def test_load_ahead_uses_free_pages_only_and_admission_then_hits():
    ap = make(num_blocks=1 + 40)
    assert ap.acquire("r1", lr(4))  # 17 pages in use; 23 free
    assert not ap.load_ahead(lr(3), reserve=15)  # 9 pages would leave 14 < 15 free
    assert ap.take_step().loads and 3 not in ap.resident
    assert ap.load_ahead(lr(3), reserve=14)
    (load,) = ap.take_step().loads
    assert load.ahead and load.lora_request.lora_int_id == 3 and len(load.page_ids) == 9
    assert ap.resident[3].refs == 0 and 3 in ap._idle and ap.stats.ahead == 1
    assert not ap.load_ahead(lr(3), reserve=0)  # resident: nothing to do
    assert not ap.load_ahead(lr(1), reserve=14)  # never evicts to make room
    assert set(ap.resident) == {4, 3}
    check_invariants(ap)
    assert ap.acquire("r2", lr(3))  # the waiting request's admission: a hit, no load
    assert not ap.take_step().loads and ap.stats.hits == 1 and ap.resident[3].refs == 1
    check_invariants(ap)


def test_older_idle_adapters_are_evicted_before_one_loaded_ahead():
    """Loaded ahead = most recently used: older idle adapters go first."""
    ap = make(num_blocks=1 + 3 + 5 + 9)
    assert ap.acquire("r1", lr(1))
    ap.release("r1")  # idle, least recently used
    assert ap.load_ahead(lr(2), reserve=0)
    assert ap.evict_lru() and set(ap.resident) == {2}
    check_invariants(ap)


def test_load_ahead_needs_a_free_slot():
    ap = make(max_slots=1)
    assert ap.acquire("r1", lr(1))
    assert not ap.load_ahead(lr(2), reserve=0) and set(ap.resident) == {1}


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_every_invariant(seed):
    rng = random.Random(seed)
    ap = make(num_blocks=80, max_slots=4)
    live: list[str] = []
    for n in range(400):
        if live and rng.random() < 0.45:
            ap.release(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.05:
            ap.forget(rng.choice(list(PAGES)))
        elif rng.random() < 0.1:
            ap.load_ahead(lr(rng.choice(list(PAGES))), reserve=rng.randrange(10))
        else:
            req = f"r{n}"
            if ap.acquire(req, lr(rng.choice(list(PAGES)))):
                live.append(req)
        if rng.random() < 0.3:
            ap.take_step()
        check_invariants(ap)


def test_an_admission_never_takes_its_own_prefix_hits_as_adapter_pages():
    """A request's prefix-cache hits are free blocks (ref 0) until vLLM's
    allocate_slots touches them: taken as its adapter's pages first, the
    request would read the adapter's weights as its KV. They stay out of
    the adapter's reach, and free, for allocate_slots to take."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from vllm_loraserve.scheduler.scheduler import PoolSchedulerMixin
    from vllm_loraserve.scheduler.waits import AdapterWaits

    pool = BlockPool(12, enable_caching=True, hash_block_size=16)
    ap = AdapterPages(pool, lambda r: (8, PAGES[r.lora_int_id]), 4)
    hits = pool.get_new_blocks(4)
    pool.free_blocks(hits)  # back at the head of the free queue: taken first
    assert pool.free_block_queue.get_all_free_blocks()[:4] == hits

    def allocate_slots(request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0):
        pool.touch(new_computed_blocks.blocks[0])  # as vLLM's: the hits, then new blocks
        return KVCacheBlocks((list(new_computed_blocks.blocks[0]) + pool.get_new_blocks(1),))

    sched = SimpleNamespace(adapter_pages=ap, _adapter_failures={}, _waits=[],
                            _adapter_waits=AdapterWaits())
    allocate = PoolSchedulerMixin._make_allocate(sched, allocate_slots)
    request = SimpleNamespace(request_id="r", lora_request=lr(2))  # 5 pages
    got = allocate(request, 16, num_new_computed_tokens=64,
                   new_computed_blocks=KVCacheBlocks((hits,)))
    assert got is not None and got.blocks[0][:4] == hits
    assert not {b.block_id for b in hits} & {b.block_id for b in ap.resident[2].blocks}
    assert all(b.ref_cnt == 1 for b in hits)  # the request's alone
    # The request's KV ends (its adapter stays, in use): 6 blocks free, 4 of them
    # another request's hits, so its 9-page adapter does not fit.
    pool.free_blocks(got.blocks[0])
    assert not ap.acquire("r2", lr(3), hits)
    assert all(b.ref_cnt == 0 for b in hits) and pool.get_num_free_blocks() == 6
    check_invariants(ap)


def test_a_replaced_adapter_in_use_takes_no_new_request():
    """After an in-place reload the old version's pages serve only the
    requests that held them: a new request waits, and gets the new version
    once the old one's requests end."""
    ap = make()
    assert ap.acquire("old", lr(2))
    ap.take_step()
    ap.forget(2)  # the reload
    assert ap.replaced_in_use(2)
    assert not ap.acquire("new", lr(2)) and not ap.holds("new")
    ap.release("old")  # stale and idle: its pages go
    assert 2 not in ap.resident and not ap.replaced_in_use(2)
    assert ap.acquire("new", lr(2)) and [ld.slot for ld in ap.take_step().loads] == [0]
    # a removed one is different: requests admitted before its removal join it
    assert not ap.removed(2)
    ap.forget(2, removed=True)
    assert ap.removed(2) and not ap.load_ahead(lr(2), 0)
    assert not ap.replaced_in_use(2) and ap.acquire("late", lr(2))
    check_invariants(ap)


def test_a_prefix_cache_reset_that_preempts_everything_frees_their_adapters_too():
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts every
    running request (releasing their adapters), then resets the block pool,
    which needs every block free: the adapters they used go then."""
    from vllm_loraserve.scheduler.scheduler import PoolSchedulerMixin

    ap = make()
    assert ap.acquire("idle", lr(1)) and ap.acquire("running", lr(2))
    ap.release("idle")
    reset = PoolSchedulerMixin._make_reset(SimpleNamespace(adapter_pages=ap),
                                           ap.block_pool.reset_prefix_cache)
    assert not reset()  # a request still holds adapter 2: as vLLM, no reset
    assert 1 not in ap.resident and 2 in ap.resident
    ap.release("running")  # vLLM's preemption of every running request
    assert reset() and not ap.resident
