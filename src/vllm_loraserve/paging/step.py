"""What the scheduler tells the workers about adapter pages, once per step.

The scheduler owns every page decision (it owns vLLM's only BlockPool); the
workers copy weights into the pages and compute with them. `PoolStep` rides
on vLLM's `SchedulerOutput` as the attribute `loraserve` (a plain dataclass,
so it survives the pickled multiprocess path), and workers apply it before
the step's forward pass: first `evicted`, then `loads`; `prefetch` only
starts background reads, and `keep` (state, not deltas: replaced by every
step) says which host-tier entries waiting requests still need.

The way back is `PoolReport`, on the step's `ModelRunnerOutput` under the
same attribute: the worker's state (not deltas), so a report that never
arrives (an empty step the engine short-cuts) loses nothing; but a
transient failure (`PoolReport.transient`) is named in the one report built
after it (worker/hooks.py puts every report it builds on a step's output).

Invariant: after applying every `PoolStep` in order, a worker's slot table
equals the scheduler's resident set, and every adapter a scheduled request
uses is in it, except adapters the worker could not read: their tokens run
without LoRA, and the worker's next report names them, so the scheduler
fails their requests before their tokens are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP_ATTR = "loraserve"
REPORT_ATTR = "loraserve"
# Removed adapter ids each side remembers: a request admitted before its
# adapter's runtime remove may still need it (ids are never reused, so the
# oldest are the least likely to come back).
MAX_REMOVED_IDS = 4096
# The end of a transient failure's reason (`PoolReport.transient`): its
# requests' error says so, and the API server, which gets the reason alone
# (a request's stop_reason), does not mark the adapter invalid for it.
TRANSIENT_NOTE = " (a transient error: a retry loads the adapter again)"


@dataclass(frozen=True)
class PageLoad:
    """Write adapter `lora_request` (rank `rank`) into `page_ids`; it lives in `slot`.

    `ahead`: no request of this step uses it (S-LoRA's prefetch into pages,
    for a waiting request); the worker may copy it alongside the step's
    forward pass, on a side stream, as long as it is complete before the
    next step's."""

    slot: int
    lora_request: Any  # vllm.lora.request.LoRARequest
    rank: int
    page_ids: tuple[int, ...]
    ahead: bool = False


@dataclass(frozen=True)
class Prefetch:
    """Read `lora_request` into the host tier ahead of its requests; `pages`
    (per layer, 0 if the scheduler could not size it) lets the worker check
    that the tier has room before it reads."""

    lora_request: Any  # vllm.lora.request.LoRARequest
    pages: int


@dataclass
class PoolStep:
    evicted: list[int] = field(default_factory=list)  # slots freed this step
    loads: list[PageLoad] = field(default_factory=list)
    # Adapters of waiting requests that are not resident (S-LoRA's prefetch):
    # workers start reading them into their host tier in the background.
    prefetch: list[Prefetch] = field(default_factory=list)
    # Adapters in the workers' host tier that waiting requests need and the
    # pool does not hold: their host entries are evicted last.
    keep: list[int] = field(default_factory=list)  # lora ids
    # Seconds each request admitted this step waited for its adapter (0 when
    # it was resident or in the host tier at once); for /metrics, which reads
    # the workers.
    waits: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.evicted or self.loads or self.prefetch or self.keep or self.waits)


@dataclass(frozen=True)
class PoolReport:
    """A worker's host tier as the scheduler needs it for admission."""

    host_ready: frozenset[int]  # lora ids whose weights are in host memory
    failed: dict[int, str]  # lora id -> why its weights could not be read or loaded
    # The failed ids whose failure was transient (worker/host_tier.py
    # `is_transient`): their waiting and running requests fail, and the
    # next report no longer names them, so a later request loads them again.
    transient: frozenset[int] = frozenset()
