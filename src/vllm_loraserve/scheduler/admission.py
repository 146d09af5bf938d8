"""The order in which waiting requests are offered to vLLM's admission.

vLLM admits waiting requests in queue order and stops at the first whose KV
blocks do not fit. With the pool, what a request costs a step depends on its
adapter: one that a running request already uses adds no pages and no
adapter bytes to the step; any other adds its adapter's pages (taken from
KV) and its bytes, read once in every step it runs. A policy may reorder the
FCFS queue before each step's admissions; it never drops or hides a request.

Policies, by name (`--loraserve-admission`):
- `fcfs`: vLLM's order, unchanged.
- `affinity`: requests whose adapter is in use (or that have none) go first,
  each group in queue order. A request that such a reordering put behind a
  later one in MAX_PASSES steps goes first from then on, so no request
  waits more than MAX_PASSES steps for the policy. When everything waiting
  fits, everything is admitted in the same step, as with `fcfs`: the order
  matters only when KV runs out.

Invariants (tests/scheduler/test_admission.py): a reordering is a
permutation of the queue; within each group the queue order holds; a
request is passed over at most MAX_PASSES times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_loraserve.scheduler.queues import take_out

# Steps a request may be passed over before it goes first. In the step
# simulation of the e2e protocol (benchmarks/e2e/admission_sim.py, 1000
# adapters), 8 cut adapter bytes 13% and 32 cut them 13.5%; 8 bounds the
# delay at 8 steps' time (a few hundred ms on an H200).
MAX_PASSES = 8


class Admission(Protocol):
    def order(self, queue: Any, in_use: Callable[[int], bool], policy: Any) -> None:
        """Reorder vLLM's waiting `queue` in place before a step's admissions;
        `in_use(lora_id)`: a running request holds that adapter."""


class Fcfs:
    def order(self, queue: Any, in_use: Callable[[int], bool], policy: Any) -> None:
        return None


@dataclass
class AdapterAffinity:
    max_passes: int = MAX_PASSES
    _passes: dict[str, int] = field(default_factory=dict)  # request id -> times passed

    def order(self, queue: Any, in_use: Callable[[int], bool], policy: Any) -> None:
        requests = list(queue)
        first: list[Any] = []
        later: list[tuple[int, Any]] = []
        last_first = -1  # queue position of the last request that goes first
        for pos, r in enumerate(requests):
            lr = r.lora_request
            if lr is None or in_use(lr.lora_int_id) or \
                    self._passes.get(r.request_id, 0) >= self.max_passes:
                first.append(r)
                last_first = pos
            else:
                later.append((pos, r))
        # Admitted and finished requests drop out; aged ones keep their count.
        passes = {r.request_id: self._passes[r.request_id] for r in first
                  if r.request_id in self._passes}
        for pos, r in later:
            passed = pos < last_first  # a request behind it goes first
            passes[r.request_id] = self._passes.get(r.request_id, 0) + passed
        self._passes = passes
        if later and later[0][0] < last_first:  # the order changes
            queue.prepend_requests(take_out(queue, first, policy))


ADMISSIONS: dict[str, Callable[[], Admission]] = {"fcfs": Fcfs, "affinity": AdapterAffinity}
