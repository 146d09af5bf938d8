"""The paged worker manager's handling of a failed page load, over a fake
device pool and the real host tier: an out-of-memory error while packing
or writing pages fails that load's requests once (transient), and the next
load of the adapter writes it; any other error stays (sticky). Meanwhile
the adapter's tokens run without LoRA, even in a step scheduled before the
scheduler heard."""

from __future__ import annotations

import errno
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from vllm_loraserve.paging.step import TRANSIENT_NOTE, PageLoad, PoolStep
from vllm_loraserve.worker.arena import ALIGN, PinnedArena
from vllm_loraserve.worker.host_tier import HostTier
from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

from .test_host_tier import settle

PLACEMENT = SimpleNamespace(rank=8, num_pages=2)


class Pool:
    """What the manager asks of DevicePool on the block path."""

    def __init__(self):
        self.layout, self.slot_of, self.ignored = object(), {}, None

    def load(self, slot, lora_id, placement, page_ids, streams):
        self.slot_of[lora_id] = slot

    def evict(self, slot):
        self.slot_of = {i: s for i, s in self.slot_of.items() if s != slot}

    def set_tokens(self, ids, ignored):
        self.ignored = ignored


def manager(pack):
    """A PagedWorkerLoRAManager on the CPU in block mode, without vLLM's
    model: `pack(entry)` stands for packing on the device."""
    m = PagedWorkerLoRAManager.__new__(PagedWorkerLoRAManager)

    def read(req, alloc):
        alloc(ALIGN)
        return SimpleNamespace(placement=PLACEMENT)

    m.host = HostTier(PinnedArena(4 * ALIGN, 1, pinned=False), read, threads=1)
    m.pool, m.cold, m._side = Pool(), None, None
    m._lock, m._waits, m._events = threading.Lock(), deque(), deque(maxlen=8)
    m._dummy_ids, m._failed_loads = set(), set()
    m.page_loads = m.page_evictions = m.page_loads_ahead = m.host_overflow_loads = 0
    m.prefetch_hits = m.prefetch_misses = m.dropped_events = 0
    m.load_pack_s = m.load_write_s = 0.0
    m._device_streams = pack
    m._warming = set()
    return m


def load_step(m, lora_id):
    req = SimpleNamespace(lora_int_id=lora_id, lora_name=f"a{lora_id}")
    m.apply_step(PoolStep(loads=[PageLoad(0, req, PLACEMENT.rank, (1, 2))]))


def tokens(m, *ids):
    """The step's tokens: which adapters run without LoRA."""
    m.set_active_adapters(set(), SimpleNamespace(index_mapping=list(ids)))
    return m.pool.ignored


def raise_first(errors):
    if errors:
        raise errors.pop(0)


def test_an_out_of_memory_page_write_fails_once_and_the_next_load_writes_it():
    errors = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")]
    m = manager(lambda entry: raise_first(errors))
    load_step(m, 5)
    assert 5 not in m.pool.slot_of and tokens(m, 5, 0) == {5}
    report = m.report()
    assert report.transient == {5} and report.failed[5].startswith(
        "its pages could not be written: OutOfMemoryError: CUDA out of memory") and \
        report.failed[5].endswith(TRANSIENT_NOTE)
    # A step scheduled before the scheduler took that report still runs 5's
    # tokens: without LoRA, though the next report no longer names it.
    assert not m.report().failed and tokens(m, 5) == {5}
    load_step(m, 5)  # the scheduler loads it again for a later request
    assert m.pool.slot_of == {5: 0} and tokens(m, 5) == set() and not m.report().failed
    m.host.shutdown()


@pytest.mark.parametrize(("error", "transient"), [(MemoryError(), True),
                                                  (ValueError("a shape mismatch"), False)],
                         ids=["host-oom", "content"])
def test_a_page_write_error_is_sticky_unless_transient(error, transient):
    m = manager(lambda entry: raise_first([error]))  # every write fails
    load_step(m, 5)
    assert m.report().transient == ({5} if transient else set())
    assert (5 in m.report().failed) is not transient
    assert tokens(m, 5) == {5}
    m.host.shutdown()


def _warm_manager(read):
    m = manager(lambda: None)
    m.host = HostTier(PinnedArena(4 * ALIGN, 1, pinned=False), read, threads=1)
    return m


def _req(lora_id, pages=1):
    return SimpleNamespace(lora_int_id=lora_id, lora_name=f"a{lora_id}", nbytes=pages * ALIGN)


def test_warm_reads_into_the_host_tier_and_says_where_the_adapter_stands():
    """The prefetch route's worker side: a background read when the tier has
    room beside the entries it keeps ("reading", then "host"); "no-room"
    beside a read under way, beside what waiting requests need, and beside
    what was read since the last step (an idle server keeps what it
    prefetched); once a step has reported it, a prefetch may evict it."""
    gate = threading.Event()

    def read(req, alloc):
        alloc(req.nbytes)
        if req.lora_int_id == 1:
            assert gate.wait(60)
        return SimpleNamespace(placement=PLACEMENT)

    m = _warm_manager(read)
    assert m.warm(_req(1, 3), 3 * ALIGN) == ("reading", None)
    assert m.warm(_req(1, 3), 3 * ALIGN) == ("reading", None)  # not read twice
    assert m.warm(_req(2, 2), 2 * ALIGN) == ("no-room", None)  # 3 pages reserved of 4
    gate.set()
    settle(m.host)
    assert m.warm(_req(1, 3), 3 * ALIGN) == ("host", None)
    assert m.warm(_req(2, 2), 2 * ALIGN) == ("no-room", None)  # 1 is fresh: kept
    assert m.host.report().host_ready == {1}  # a step ran
    m.host.set_keep({1})  # a waiting request needs it
    assert m.warm(_req(2, 2), 2 * ALIGN) == ("no-room", None) and 1 in m.host
    m.host.set_keep(())
    assert m.warm(_req(2, 2), 2 * ALIGN)[0] in ("reading", "host")
    settle(m.host)
    assert m.warm(_req(2, 2), 2 * ALIGN) == ("host", None) and 1 not in m.host
    m.host.shutdown()


def test_warm_answers_a_transient_failure_once_and_reads_again():
    """An I/O error is the ask's answer once, then forgotten: the next ask
    reads again, and no step's report fails a request for it."""
    errors = [OSError(errno.EIO, "disk gone")]

    def read(req, alloc):
        alloc(req.nbytes)
        if errors:
            raise errors.pop()
        return SimpleNamespace(placement=PLACEMENT)

    m = _warm_manager(read)
    assert m.warm(_req(3), ALIGN)[0] in ("reading", "failed")
    settle(m.host)
    state, reason = m.warm(_req(3), ALIGN)
    assert state == "failed" and "disk gone" in reason and reason.endswith(TRANSIENT_NOTE)
    assert not m.host.report().failed  # forgotten: nothing for the scheduler
    assert m.warm(_req(3), ALIGN)[0] in ("reading", "host")
    settle(m.host)
    assert m.warm(_req(3), ALIGN) == ("host", None)
    m.host.shutdown()


def test_warm_says_no_room_where_its_read_gave_up_for_want_of_a_whole_extent():
    """The tier's free bytes suffice but lie in two holes of one page (two
    chunks of two pages, a kept entry in each): the background read gives
    up, and nothing is under way, so the answer is "no-room", not "reading"."""
    m = manager(lambda: None)

    def read(req, alloc):
        alloc(req.nbytes)
        return SimpleNamespace(placement=PLACEMENT)

    m.host = HostTier(PinnedArena(2 * ALIGN, 2, pinned=False), read, threads=1)
    for i in (5, 6, 7):  # 5 and 6 share chunk 0 (best fit), 7 takes chunk 1
        assert m.warm(_req(i), ALIGN)[0] in ("reading", "host")
        settle(m.host)
    m.host.report()
    assert m.host.remove(6)  # a hole of one page in each chunk
    m.host.set_keep({5, 7})
    assert m.host.has_room(2 * ALIGN)  # by bytes
    first = m.warm(_req(8, 2), 2 * ALIGN)  # "no-room" if it gave up already
    settle(m.host)
    if first[0] == "reading":  # the next ask finds it gave up
        assert m.warm(_req(8, 2), 2 * ALIGN) == ("no-room", None)
    else:
        assert first == ("no-room", None)
    assert sorted(m.host.ids()) == [5, 7]
    m.host.shutdown()
