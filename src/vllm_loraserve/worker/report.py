"""What a worker tells the API server about its adapters (`loraserve_residency`).

The worker builds a `ResidencyReport` when it is asked: the API server asks
when the adapter list or `/metrics` is read (frontend/endpoint.py), offline
scripts and benchmarks through `LLM.collective_rpc`. The paged pool's manager
(worker/paged_manager.py) fills every field; with vLLM's own slots
(worker/residency.py) the pool's fields are absent. It is not the scheduler's
`PoolReport` (paging/step.py), which rides on every step's output.

It crosses two process boundaries: worker -> engine core (pickled) and
engine core -> API server (vLLM's msgpack, which sends a utility call's result
as plain lists and maps unless insecure serialisation is allowed). So it
travels as its wire form, a plain dict: `to_wire` in the RPC
(worker/extension.py), `from_wire` where it is read. The wire's keys are the
field names, and offline scripts read them (`pool["adapter_step_bytes"]`,
...): renaming a field renames a key.

Totals (`PoolCounters`, `dropped_events`) count since the worker started;
`events` and `adapter_waits` are those since the last report, which drains
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


class LoadEvent(NamedTuple):
    """One adapter load and how long it took, in seconds."""

    lora_id: int
    # "host": disk -> host memory; "gpu": host memory -> what the kernels
    # read (vLLM's slots or the pool's pages), also on a CPU machine.
    tier: str
    seconds: float


@dataclass(frozen=True)
class PoolCounters:
    """The paged pool's levels and totals (frontend/metrics.py exports them)."""

    page_loads: int  # adapter loads into KV pages (from the host tier)
    page_evictions: int  # adapters whose pages were given back
    # Loads among `page_loads` made for waiting requests before their
    # admission (copied beside a step's forward pass on a GPU).
    page_loads_ahead: int
    # Host seconds of the page loads: packing into page layout on the device
    # (the copy of the file's bytes included), then writing the pages and
    # the slot table. Rounded to 0.1 ms.
    load_pack_s: float
    load_write_s: float
    adapter_pages: int  # KV pages (per layer) adapters hold now
    total_pages: int  # KV pages per layer; 0 before the pool is bound
    page_size: int  # elements of one page; 0 before the pool is bound
    peak_batch_adapters: int  # most distinct adapters in one step
    # Over the steps with adapter tokens: how many, their distinct adapters,
    # those adapters' ranks, and the bytes of A and B they hold in all layers
    # (what the step's kernels must read at least once: the memory roofline),
    # each summed over the steps.
    adapter_steps: int
    adapter_step_adapters: int
    adapter_step_ranks: int
    adapter_step_bytes: int
    host_bytes: int  # bytes of the adapters in the host tier now
    host_adapters: int  # adapters in the host tier now
    host_budget: int  # the host tier's bytes at most
    # Page loads whose adapter was in the host tier already (read ahead or
    # kept), and those that had to read it, or wait for it, in the step.
    prefetch_hits: int
    prefetch_misses: int
    # Page loads a step issued early, whole, before reading its other
    # adapters into their host memory: the step's adapters outgrew the host
    # tier (cold modes load these without layer groups).
    host_overflow_loads: int = 0
    # --loraserve-cold-start, and what its layer-group loads did: (adapter,
    # layer group) pairs written by groups (pipelined and cpu-assist), and
    # those whose LoRA delta was computed on the CPU while their pages were
    # written (cpu-assist).
    cold_start: str = "block"
    pipelined_groups: int = 0
    assisted_groups: int = 0
    # cpu-assist: the CPU worker processes computing its deltas now (0: the
    # engine's own threads, also after the workers failed).
    cpu_assist_workers: int = 0
    # cpu-assist: CPU delta jobs enqueued without a host wait (the sync-free
    # path: the workers with the csrc/ op on a GPU, or on the CPU).
    sync_free_jobs: int = 0
    # --loraserve-read-in processes: the host tier's reader processes alive
    # now, the files they read, and how many replaced one that died, hung or
    # was interrupted (all 0: reads on the tier's threads).
    reader_processes: int = 0
    reader_reads: int = 0
    reader_respawns: int = 0
    # --loraserve-read-pause: the reads' seconds parked while the engine
    # thread held the read gate closed, summed over reading threads.
    read_paused_s: float = 0.0


@dataclass(frozen=True)
class ResidencyReport:
    """Which tier each adapter is in on this worker, and what happened since
    the last report.

    Invariant: an id is in `gpu` or `host`, never both (a device-resident
    adapter's host copy counts as "gpu"); `pages` and `pool` are given
    together (paged pool) or not at all (vLLM's slots)."""

    gpu: tuple[int, ...]  # ids the kernels can read now, ascending
    host: tuple[int, ...]  # ids only in host memory, ascending
    events: tuple[LoadEvent, ...]  # loads since the last report, oldest first
    # Events not kept since the worker started: the buffer was full because
    # no report drained it (the load counters undercount by this much).
    dropped_events: int
    pages: dict[int, int] | None = None  # per id in `gpu`: its pages per layer
    # Seconds each request admitted since the last report waited for its
    # adapter (0 when it was ready at once); paged pool only.
    adapter_waits: tuple[float, ...] = ()
    pool: PoolCounters | None = None

    def __post_init__(self) -> None:
        if (self.pages is None) != (self.pool is None):
            raise ValueError("a residency report has pages and pool counters together or "
                             "neither")

    def to_wire(self) -> dict[str, Any]:
        """Plain lists, maps and numbers (with the keys offline scripts read)."""
        wire: dict[str, Any] = {"gpu": list(self.gpu), "host": list(self.host)}
        if self.pool is not None:
            wire["pages"] = dict(self.pages)
        wire["events"] = [tuple(e) for e in self.events]
        wire["dropped_events"] = self.dropped_events
        if self.pool is not None:
            wire["adapter_waits"] = list(self.adapter_waits)
            wire["pool"] = dataclasses.asdict(self.pool)
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> ResidencyReport:
        pool = wire.get("pool")
        return cls(gpu=tuple(wire["gpu"]), host=tuple(wire["host"]),
                   events=tuple(LoadEvent(*e) for e in wire["events"]),
                   dropped_events=wire["dropped_events"],
                   pages=dict(wire["pages"]) if "pages" in wire else None,
                   adapter_waits=tuple(wire.get("adapter_waits", ())),
                   pool=PoolCounters(**pool) if pool is not None else None)
