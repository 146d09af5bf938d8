"""How the scheduler takes the workers' failures (`PoolReport.failed`): a
sticky one fails the adapter's requests until it is removed or reloaded; a
transient one fails the requests of that moment, once, and a later request
loads the adapter again. With the worker's real host tier and a fake read."""

from __future__ import annotations

import errno
from types import SimpleNamespace

from vllm_loraserve.paging.step import REPORT_ATTR, PoolReport
from vllm_loraserve.scheduler.scheduler import PoolSchedulerMixin
from vllm_loraserve.worker.arena import ALIGN, PinnedArena
from vllm_loraserve.worker.host_tier import HostTier

from ..worker.test_host_tier import settle


class Pages:
    """What the scheduler asks of AdapterPages here."""

    def __init__(self, resident=()):
        self.resident, self.forgotten = set(resident), []

    def forget(self, lora_id, removed=False):
        self.forgotten.append(lora_id)
        self.resident.discard(lora_id)

    def replaced_in_use(self, lora_id):
        return False


class Sched(PoolSchedulerMixin):
    def __init__(self, resident=()):  # vLLM's scheduler is not built: the mixin's state only
        self.running, self.waiting, self.skipped_waiting = [], [], []
        self.adapter_pages = Pages(resident)
        self._adapter_demands, self._adapter_failures = {}, {}
        self._host_ready, self._read_failures = frozenset(), {}
        self._demand = lambda lr: (8, 1)

    def take(self, report: PoolReport) -> None:
        self._take_report(SimpleNamespace(**{REPORT_ATTR: report}))

    def update(self) -> set[str]:
        """What update_from_output does with the failures: those requests finish."""
        failed = set(self._adapter_failures)
        for queue in (self.running, self.waiting, self.skipped_waiting):
            queue[:] = [r for r in queue if r.request_id not in failed]
        self._adapter_failures.clear()
        return failed


def request(rid: str, lora_id: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid,
                           lora_request=SimpleNamespace(lora_int_id=lora_id,
                                                        lora_name=f"a{lora_id}"))


def test_an_io_error_fails_the_waiting_request_and_the_next_one_reads_again():
    errors = {7: [OSError(errno.EIO, "Input/output error")]}  # the first read of 7 fails

    def read(req, alloc):
        buf = alloc(ALIGN)
        if errors.get(req.lora_int_id):
            raise errors[req.lora_int_id].pop(0)
        return buf

    tier = HostTier(PinnedArena(4 * ALIGN, 1, pinned=False), read, threads=1)
    s = Sched()

    def step():
        """Hints to the tier, its reads, its report to the scheduler."""
        for hint in s._host_plan()[0]:
            tier.prefetch(hint.lora_request, ALIGN)
        settle(tier)
        s.take(tier.report())
        return s.update()

    s.waiting.append(request("r1", 7))
    assert step() == {"r1"}  # the read failed: its request too, with why
    assert s.adapter_pages.forgotten == [7]
    s.waiting.append(request("r2", 7))
    assert step() == set() and s._ready(7)  # read again, and this time it serves
    assert 7 in tier and s.waiting == [request("r2", 7)]
    tier.shutdown()


def test_a_transient_failure_fails_each_request_of_its_moment_once():
    s = Sched(resident={5})
    s.running = [request("run", 5)]
    s.waiting = [request("w1", 5), request("other", 6)]
    s.skipped_waiting = [request("w2", 5)]
    why = "its pages could not be written: OutOfMemoryError (a transient error: ...)"
    s.take(PoolReport(frozenset({6}), {5: why}, frozenset({5})))
    assert s._adapter_failures == {"run": why, "w1": why, "w2": why}
    assert s.adapter_pages.forgotten == [5] and not s._read_failures
    s.update()
    # Reported once: a later request is not failed, and is hinted (read again).
    s.take(PoolReport(frozenset({6}), {}))
    s.waiting.append(request("w3", 5))
    assert not s._adapter_failures and [h.lora_request.lora_int_id
                                        for h in s._host_plan()[0]] == [5]
    # Its retry fails again (in the very next report): its requests fail again.
    s.running = [request("run2", 5)]
    s.take(PoolReport(frozenset({6}), {5: why}, frozenset({5})))
    s.take(PoolReport(frozenset({6}), {5: why}, frozenset({5})))
    assert s.update() == {"run2", "w3"} and s.adapter_pages.forgotten == [5, 5, 5]


def test_a_content_failure_stays():
    s = Sched(resident={5})
    s.running, s.waiting = [request("run", 5)], [request("w1", 5)]
    s.take(PoolReport(frozenset(), {5: "tensor lora_B of m holds non-finite values"}))
    # Running requests now; waiting ones (now or later) when schedule() sets them aside.
    assert s.update() == {"run"} and s.adapter_pages.forgotten == [5]
    s.take(PoolReport(frozenset(), {5: "tensor lora_B of m holds non-finite values"}))
    assert 5 in s._read_failures and s.adapter_pages.forgotten == [5]
    assert s._host_plan() == ([], [])  # never read again
