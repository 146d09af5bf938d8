"""The order in which waiting requests are offered to vLLM's admission.

vLLM admits waiting requests in queue order and stops at the first whose KV
blocks do not fit. With the pool, what a request costs a step depends on its
adapter: one that a running request already uses adds no pages and no
adapter bytes to the step; any other adds its adapter's pages (taken from
KV) and its bytes, read once in every step it runs. A policy may reorder the
FCFS queue before each step's admissions; it never drops or hides a request.

Policies, by name (`--loraserve-admission`):
- `fcfs`: vLLM's order, unchanged.
- `affinity`: preferred requests (the scheduler's choice: no adapter, an
  adapter in use, or a preempted request resuming) go first, each group in
  queue order. A request that a reordering once put behind a later one
  starts a clock; after MAX_WAIT_STEPS steps in the queue it goes to the
  front, ahead of every preferred request. When everything waiting fits,
  everything is admitted in the same step, as with `fcfs`: the order matters
  only when KV runs out.

Invariants (tests/scheduler/test_admission.py): a reordering is a
permutation of the queue; within each group the queue order holds; a request
passed over is at the queue's front after at most MAX_WAIT_STEPS steps in the
queue, whatever happens meanwhile (steps set aside out of the queue do not
count and do not reset its clock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_loraserve.scheduler.queues import take_out

# Steps a passed-over request waits in the queue before it goes to the front:
# a few hundred ms on an H200. In the step model of the e2e protocol
# (benchmarks/e2e/admission_sim.py; docs/benchmarks/e2e.md, session 33) 8
# cut adapter bytes 5% at 1000 adapters, 32 cut them 11%.
MAX_WAIT_STEPS = 8


class Admission(Protocol):
    def order(self, queue: Any, preferred: Callable[[Any], bool],
              waiting: Callable[[str], bool], policy: Any) -> None:
        """Reorder vLLM's waiting `queue` in place before a step's admissions.
        `preferred(request)`: the request adds no adapter to the step (or is
        owed its place); `waiting(request_id)`: the request is neither admitted
        nor finished (it may be out of `queue` this step, set aside)."""


class Fcfs:
    def order(self, queue: Any, preferred: Callable[[Any], bool],
              waiting: Callable[[str], bool], policy: Any) -> None:
        return None


@dataclass
class AdapterAffinity:
    max_wait_steps: int = MAX_WAIT_STEPS
    _clock: dict[str, int] = field(default_factory=dict)  # request id -> steps since passed

    def order(self, queue: Any, preferred: Callable[[Any], bool],
              waiting: Callable[[str], bool], policy: Any) -> None:
        self._clock = {rid: n for rid, n in self._clock.items() if waiting(rid)}
        requests = list(queue)
        aged: list[Any] = []
        first: list[Any] = []
        later: list[tuple[int, Any]] = []
        last_ahead = -1  # queue position of the last request that goes ahead
        for pos, r in enumerate(requests):
            if self._clock.get(r.request_id, 0) >= self.max_wait_steps:
                aged.append(r)
            elif preferred(r):
                first.append(r)
            else:
                later.append((pos, r))
                continue
            last_ahead = pos
        for pos, r in later:  # passed over now, or waiting since it was
            if r.request_id in self._clock or pos < last_ahead:
                self._clock[r.request_id] = self._clock.get(r.request_id, 0) + 1
        ahead = aged + first
        if any(a is not b for a, b in zip(ahead, requests[:len(ahead)], strict=True)):
            queue.prepend_requests(take_out(queue, ahead, policy))


ADMISSIONS: dict[str, Callable[[], Admission]] = {"fcfs": Fcfs, "affinity": AdapterAffinity}
