"""A per-step trace of the pool, for diagnosis (opt-in, off by default).

With `LORASERVE_STEP_TRACE=PREFIX` in a worker's environment, the worker
appends one JSON line per step (idle ones too: they apply page loads) to
`PREFIX-<pid>.jsonl` (benchmarks/e2e/bench_e2e.py --step-trace reads it).
Host clocks and counters only: it never waits for the device, so it
changes no step's timing but for the write of one line and a read of the
caching allocator's counters (under its lock, held during a free).

Fields of a line:
- `mono`: `time.monotonic()` at the step's start (execute_model), one clock
  for every process of the machine;
- `period_s`: since the previous traced step's start. Where the engine waits
  for each step's output before it schedules the next (vLLM's synchronous
  scheduling), this is the step's whole time;
- `host_s`: the worker's time in the step (page decisions, the forward's
  launches, its end); `apply_s`: its first part, the page decisions and
  loads, before the forward's launches;
- `cpu_s`: the worker thread's CPU time within `host_s`; the rest of
  `host_s` it waited without running: for the GIL (which the host tier's
  reader threads share), a lock, I/O or the device; `apply_cpu_s`: its
  CPU time within `apply_s`;
- `gap_s`: since the previous traced step's end: the worker thread's time
  outside the runner's `execute_model` (in one process with the engine,
  as offline with one GPU: vLLM's scheduling, its output processing and,
  on V1 with asynchronous scheduling, `sample_tokens` with the wait for the
  step's output and the PoolReport);
- `gap_cpu_s`: the worker thread's CPU time within `gap_s` (vLLM's
  scheduling and output processing); the rest of `gap_s` it waited without
  running: for the GIL, or for the step in flight on the GPU (vLLM's wait
  for a step's output did not count as CPU time on an H200, session 36);
- `proc_cpu_s`: the whole process's CPU time since the previous line (every
  thread, the GIL's holder among them); `threads_cpu_s`: the part of it of
  the process's other Python threads, by name less its trailing number
  (a ThreadPoolExecutor's `prefix_N`), those above 1 ms only (Linux); a
  thread started since the previous line counts from its start, one that
  ended since counts nothing of that span. Which threads ran
  while the worker thread waited, that is: not proof of who held the GIL;
- `tokens`; `loads` and `evictions`: page loads and evictions of the step;
  `adapters` and `adapter_bytes`: distinct adapters of its tokens and their
  weights' bytes (the memory roofline's share of the step);
- `gc_s` and `gc_full`: wall seconds of Python's garbage collections in
  this process since the previous line's step ended, and the full (oldest
  generation) ones among them. A collection holds the GIL but for the
  finalizers it runs, so `gc_s` bounds how long it stopped the engine
  thread, whichever thread started it;
- `device_allocs`, `device_frees`, `alloc_retries` (None before CUDA is
  initialised, and on the CPU): torch's caching allocator's device
  allocations and frees (cudaMalloc and cudaFree; with expandable segments,
  cuMemMap and cuMemUnmap too) and its failed cudaMallocs in the same span.
  A cudaFree waits for the whole device, so a step with frees may have
  waited for the step in flight (the host then loses its lead on the GPU).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import re
import threading
import time
from typing import IO

import torch

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format

ENV = "LORASERVE_STEP_TRACE"
# A line's allocator fields: torch.cuda.memory_stats' top-level counters.
ALLOCATOR_FIELDS = {"device_allocs": "num_device_alloc", "device_frees": "num_device_free",
                    "alloc_retries": "num_alloc_retries"}


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


_NUMBERED = re.compile(r"[_-]?\d+$")


def _thread_clock(tid: int) -> int:
    """Linux's CPU-time clock of thread `tid` (MAKE_THREAD_CPUCLOCK(tid,
    CPUCLOCK_SCHED)): by kernel thread id, so a thread that has ended gives
    EINVAL, where pthread_getcpuclockid of its ended pthread would be
    undefined behaviour."""
    return (~tid << 3) | 6


def _threads_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each live Python thread but this one: kernel thread id
    -> (name less its trailing number, seconds). A thread that ends between
    two lines loses its CPU time since the first."""
    out, me = {}, threading.get_native_id()
    for t in threading.enumerate():
        if t.native_id is None or t.native_id == me:
            continue
        try:
            seconds = time.clock_gettime(_thread_clock(t.native_id))
        except OSError:
            continue  # it ended since enumerate()
        out[t.native_id] = _NUMBERED.sub("", t.name), seconds
    return out


def _threads_since(now: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]]
                   ) -> dict[str, float]:
    by_name: dict[str, float] = {}
    for tid, (name, seconds) in now.items():
        prev_name, prev = last.get(tid, (name, 0.0))
        if prev_name != name:  # the id of an ended thread, taken by a new one
            prev = 0.0
        by_name[name] = by_name.get(name, 0.0) + seconds - prev
    return {name: round(s, 6) for name, s in sorted(by_name.items()) if s > 1e-3}


def _since(now: tuple, last: tuple | None) -> tuple:
    """Running totals' differences from `last` (None: from zero)."""
    return tuple(c - p for c, p in zip(now, last or (0,) * len(now), strict=True))


class StepTrace:
    """Invariant: one line per `record`, written whole (line-buffered, the
    file open for the process's life), so a worker that dies loses no
    recorded step."""

    def __init__(self, prefix: str) -> None:
        self.path = f"{prefix}-{os.getpid()}.jsonl"
        self._file: IO[str] = open(self.path, "a", buffering=1)
        self._last_start: float | None = None
        self._last_end: float | None = None
        self._last_counts: tuple[int, ...] | None = None
        self._gc_s, self._gc_full = 0.0, 0
        self._gc_t0: float | None = None
        self._last_gc: tuple[float, int] | None = None
        self._last_allocator: tuple[int, ...] | None = None
        self._last_cpu_end: float | None = None
        self._last_proc = time.process_time()
        self._last_threads = _threads_cpu()
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        self._file.close()

    def _on_gc(self, phase: str, info: dict) -> None:
        # A collection under way when this was appended reaches it at "stop" only.
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_full += info["generation"] == 2
            self._gc_t0 = None

    @staticmethod
    def _allocator() -> tuple[int, ...] | None:
        """The allocator's counters, None before CUDA is initialised (the
        nested dict: memory_stats would flatten ~150 entries in Python)."""
        stats = torch.cuda.memory_stats_as_nested_dict()
        if not stats:
            return None
        missing = [k for k in ALLOCATOR_FIELDS.values() if k not in stats]
        if missing:
            _warn_once(f"vllm-loraserve step trace: this torch's allocator has no {missing}; "
                       "the allocator fields are left empty")
            return None
        return tuple(stats[k] for k in ALLOCATOR_FIELDS.values())

    @classmethod
    def from_env(cls) -> StepTrace | None:
        prefix = os.environ.get(ENV)
        return cls(prefix) if prefix else None

    def record(self, start: float, applied: float, end: float,
               cpu: tuple[float, float, float], tokens: int,
               counts: tuple[int, int, int, int]) -> None:
        """A step from `start` to `end` (monotonic seconds), its page
        decisions done at `applied`, `cpu`: the thread's CPU clock
        (time.thread_time) at those three times, that ran `tokens`; `counts`:
        the pool's running totals of (page loads, evictions, step adapters,
        step adapter bytes) after it. The first step after start-up has no
        period and no gap; its counts are totals since then, its collections
        and the process's CPU since this trace's start, its allocator counts
        the process's."""
        loads, evictions, adapters, nbytes = _since(counts, self._last_counts)
        period = None if self._last_start is None else round(start - self._last_start, 6)
        gap = None if self._last_end is None else round(start - self._last_end, 6)
        gc_now = (self._gc_s, self._gc_full)
        gc_s, gc_full = _since(gc_now, self._last_gc)
        cpu_start, cpu_applied, cpu_end = cpu
        gap_cpu = None if self._last_cpu_end is None else round(cpu_start - self._last_cpu_end, 6)
        proc, threads = time.process_time(), _threads_cpu()
        allocator = self._allocator()
        device = (None,) * len(ALLOCATOR_FIELDS) if allocator is None else \
            _since(allocator, self._last_allocator)
        self._file.write(json.dumps({
            "mono": round(start, 6), "period_s": period, "host_s": round(end - start, 6),
            "apply_s": round(applied - start, 6), "cpu_s": round(cpu_end - cpu_start, 6),
            "apply_cpu_s": round(cpu_applied - cpu_start, 6),
            "gap_s": gap, "gap_cpu_s": gap_cpu, "proc_cpu_s": round(proc - self._last_proc, 6),
            "threads_cpu_s": _threads_since(threads, self._last_threads),
            "tokens": tokens, "loads": loads, "evictions": evictions, "adapters": adapters,
            "adapter_bytes": nbytes, "gc_s": round(gc_s, 6), "gc_full": gc_full,
            **dict(zip(ALLOCATOR_FIELDS, device, strict=True))}) + "\n")
        self._last_start, self._last_end, self._last_counts = start, end, counts
        self._last_gc, self._last_allocator = gc_now, allocator
        self._last_cpu_end, self._last_proc, self._last_threads = cpu_end, proc, threads
