"""What the router records of each engine fault, phase by phase.

One `Fault` per time an engine leaves routing (a failed health check, or an
operator's restart), with the time each phase took:

- detection: from the first sign of trouble (a failed health check, or a
  request that could not reach the engine) to the engine leaving routing;
- replacement: the placement round over the live engines that re-places
  the adapters it held (fetched from a live peer, or from the registry for
  those only it held);
- first_served: from leaving routing to the first request for one of its
  adapters answered by another engine;
- rejoin: from leaving routing to passing its health check again, and the
  placement round that gives it adapters again.

Each phase is logged with its duration, observed in the router's metrics
(`loraserve_router_fault_phase_seconds{phase}`) and listed by
`GET /admin/faults`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Histogram

logger = logging.getLogger(f"vllm.{__name__}")

PHASES = ("detection", "replacement", "first_served", "rejoin")


@dataclass
class Fault:
    engine: int
    reason: str
    held: list[str]  # the adapters it held when it left routing
    first_sign: float  # time.monotonic() of the first failed check or request
    down_at: float  # time.monotonic() when it left routing
    detection_s: float
    replacement_s: float | None = None
    # adapters it held -> their live holders after the re-placement
    replaced: dict[str, list[int]] = field(default_factory=dict)
    from_registry: list[str] = field(default_factory=list)  # only it held them
    # held adapters no live engine holds after the re-placement (a request
    # for one fetches it onto a live engine; the registry still has it)
    unplaced: list[str] = field(default_factory=list)
    first_served_s: float | None = None
    rejoin_s: float | None = None
    rejoin_placement_s: float | None = None
    given_on_rejoin: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["first_sign"], d["down_at"]  # monotonic clock: meaningless outside
        return d


class FaultLog:
    """The last `keep` faults, and the phases still open on each."""

    def __init__(self, registry: CollectorRegistry, keep: int = 100) -> None:
        self.faults: deque[Fault] = deque(maxlen=keep)
        self._awaiting_serve: list[Fault] = []
        self._awaiting_rejoin: dict[int, Fault] = {}
        self.phase_seconds = Histogram(
            "loraserve_router_fault_phase_seconds", "Duration of each phase of an engine "
            "fault (cluster/faults.py).", ["phase"], registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))

    def _observe(self, phase: str, fault: Fault, seconds: float, detail: str = "") -> None:
        self.phase_seconds.labels(phase).observe(seconds)
        logger.info("engine %s fault: %s took %.3fs%s", fault.engine, phase, seconds, detail)

    def down(self, engine: int, reason: str, held: list[str], first_sign: float | None) -> Fault:
        now = time.monotonic()
        fault = Fault(engine, reason, sorted(held), first_sign or now, now,
                      now - (first_sign or now))
        self.faults.append(fault)
        self._awaiting_rejoin[engine] = fault
        self._observe("detection", fault, fault.detection_s, f" ({reason})")
        return fault

    def replaced(self, fault: Fault, seconds: float, holders: dict[str, list[int]],
                 from_registry: list[str]) -> None:
        fault.replacement_s = seconds
        fault.replaced = holders
        fault.from_registry = sorted(from_registry)
        fault.unplaced = sorted(a for a, hs in holders.items() if not hs)
        if fault.held:
            self._awaiting_serve.append(fault)
        self._observe("replacement", fault, seconds,
                      f": {len(holders) - len(fault.unplaced)} of {len(fault.held)} adapters "
                      f"on live engines, {len(fault.from_registry)} from the registry"
                      + (f", unplaced: {fault.unplaced}" if fault.unplaced else ""))

    def served(self, adapter: str, engine: int) -> None:
        """A request for `adapter` was answered by `engine`."""
        for fault in list(self._awaiting_serve):
            if engine != fault.engine and adapter in fault.held:
                fault.first_served_s = time.monotonic() - fault.down_at
                self._awaiting_serve.remove(fault)
                self._observe("first_served", fault, fault.first_served_s,
                              f" (adapter {adapter} on engine {engine})")

    def up(self, engine: int) -> Fault | None:
        fault = self._awaiting_rejoin.pop(engine, None)
        if fault is not None:
            fault.rejoin_s = time.monotonic() - fault.down_at
            self._observe("rejoin", fault, fault.rejoin_s)
        return fault

    def given(self, fault: Fault, seconds: float, adapters: list[str]) -> None:
        fault.rejoin_placement_s = seconds
        fault.given_on_rejoin = sorted(adapters)
        logger.info("engine %s fault: the rejoin placement took %.3fs and gave it %d adapters",
                    fault.engine, seconds, len(adapters))
