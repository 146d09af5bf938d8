"""What the scheduler asks of the workers' host tier each step: read-ahead
for adapters that are not ready, keep for those that are but are not in the
device pool, in queue order."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_loraserve.adapters.peft import AdapterError
from vllm_loraserve.scheduler import scheduler as sched
from vllm_loraserve.scheduler.scheduler import PoolSchedulerMixin


def lora(i: int) -> SimpleNamespace:
    return SimpleNamespace(lora_int_id=i, lora_name=f"a{i}")


def request(i: int | None) -> SimpleNamespace:
    return SimpleNamespace(lora_request=None if i is None else lora(i))


def plan(waiting, skipped=(), resident=(), host_ready=(), failed=(), bad=()):
    def demand(lr):
        if lr.lora_int_id in bad:
            raise AdapterError("malformed")
        return 8, 10 * lr.lora_int_id

    s = SimpleNamespace(waiting=[request(i) for i in waiting],
                        skipped_waiting=[request(i) for i in skipped],
                        adapter_pages=SimpleNamespace(resident=set(resident)),
                        _host_ready=frozenset(host_ready),
                        _read_failures={i: "x" for i in failed}, _demand=demand)
    hints, keep = PoolSchedulerMixin._host_plan(s)
    return [(h.lora_request.lora_int_id, h.pages) for h in hints], keep


def test_cold_adapters_are_hinted_with_their_size_and_ready_ones_kept():
    hints, keep = plan(waiting=[1, 2, None, 3, 2, 4, 5], skipped=[6],
                       resident={3}, host_ready={2, 5, 3}, failed={4})
    # skipped_waiting first (vLLM schedules it first); each adapter once;
    # resident and failed adapters need nothing from the host tier.
    assert hints == [(6, 60), (1, 10)]
    assert keep == [2, 5]


def test_read_ahead_is_bounded_and_keep_is_not(monkeypatch):
    monkeypatch.setattr(sched, "PREFETCH_AHEAD", 2)
    hints, keep = plan(waiting=[1, 2, 3, 4, 5, 6], host_ready={5, 6})
    assert [h for h, _ in hints] == [1, 2] and keep == [5, 6]


def test_an_adapter_the_scheduler_cannot_size_is_still_read():
    # Its read fails in the worker, which reports why (and its requests fail).
    hints, _ = plan(waiting=[7], bad={7})
    assert hints == [(7, 0)]



class _Pages:
    """AdapterPages' load_ahead over a free-block count (the real one is
    tested in test_pages.py): what the scheduler asks of it, in order."""

    def __init__(self, free: int, resident=(), removed=()):
        self.free, self.resident, self.asked = free, set(resident), []
        self._removed = set(removed)

    def removed(self, lora_id):
        return lora_id in self._removed

    def load_ahead(self, lr, reserve):
        self.asked.append(lr.lora_int_id)
        if lr.lora_int_id in self.resident or lr.lora_int_id in self._removed:
            return False
        if lr.lora_int_id == 9:
            raise AdapterError("malformed")
        if self.free - 10 < reserve:
            return False
        self.free -= 10
        self.resident.add(lr.lora_int_id)
        return True


def load_ahead(waiting, free, host_ready, resident=(), failed_requests=(), removed=()):
    pages = _Pages(free, resident, removed)
    reqs = [SimpleNamespace(request_id=f"q{n}", **vars(request(i)))
            for n, i in enumerate(waiting)]
    s = SimpleNamespace(waiting=reqs, skipped_waiting=[], adapter_pages=pages,
                        _host_ready=frozenset(host_ready),
                        _adapter_failures={f"q{n}": "x" for n in failed_requests},
                        kv_cache_manager=SimpleNamespace(
                            block_pool=SimpleNamespace(num_gpu_blocks=100,
                                                       get_num_free_blocks=lambda: pages.free)))
    PoolSchedulerMixin._load_ahead(s)
    return pages


def test_load_ahead_takes_host_ready_waiting_adapters_in_queue_order():
    # 2 is not in the host tier (its read is under way); 5 is resident; 9 cannot
    # be served (its admission fails it); the reserve is 10 of 100 blocks.
    pages = load_ahead(waiting=[1, 2, None, 9, 5, 1, 3, 4], free=45,
                       host_ready={1, 3, 4, 5, 9}, resident={5})
    assert pages.asked == [1, 9, 5, 3, 4] and pages.resident == {5, 1, 3, 4}


def test_load_ahead_stops_at_the_first_adapter_without_room():
    pages = load_ahead(waiting=[1, 3, 4, 6], free=35, host_ready={1, 3, 4, 6})
    assert pages.asked == [1, 3, 4] and pages.resident == {1, 3}


def test_a_removed_adapter_is_skipped_not_taken_for_a_lack_of_room():
    # 1 was removed at runtime (its waiting request, admitted, loads it then):
    # the adapters behind it still load ahead.
    pages = load_ahead(waiting=[1, 3, 4], free=100, host_ready={1, 3, 4}, removed={1})
    assert pages.resident == {3, 4} and 1 not in pages.asked


def test_load_ahead_is_bounded_per_step(monkeypatch):
    monkeypatch.setattr(sched, "LOAD_AHEAD", 2)
    pages = load_ahead(waiting=[1, 3, 4], free=100, host_ready={1, 3, 4})
    assert pages.resident == {1, 3}


def test_a_request_already_failed_loads_nothing():
    pages = load_ahead(waiting=[1], free=100, host_ready={1}, failed_requests=[0])
    assert pages.asked == []


def test_load_ahead_asks_nothing_when_kv_is_down_to_its_reserve():
    # 10 free of 100: the reserve; no adapter fits, so the queue is not scanned.
    pages = load_ahead(waiting=[1, 3], free=10, host_ready={1, 3})
    assert pages.asked == [] and pages.resident == set()
