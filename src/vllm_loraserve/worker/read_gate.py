"""A gate that parks the host tier's reads while the engine thread launches
a forward pass, if two or more reads are under way (`--loraserve-read-pause
forward`; how many: `--loraserve-read-pause-reads`).

The tier's readers run in the engine's process and share its GIL. The
engine thread retakes the GIL after every torch call, so while reader
threads run, each retake may wait for one of them. On an H200 host
(docs/benchmarks/e2e.md, session 36) the e2e protocol's pool-1000 run read
all its 266 adapters in its first 7 seconds; in those seconds the engine
thread waited 2.0 s of its 4.6 s of step time without running, and the GPU
idled 1.0 s longer than without LoRA (none of it after them). Parked at a
checkpoint of each read (before its metadata work, before each piece of
its file, after a reader process's answer), the readers contend for the
GIL there only with what they run until their next checkpoint (at most a
read's metadata work, or a piece in flight), and read between steps,
while the engine thread schedules and waits for a step's output. Reads
with no checkpoint inside (an adapter_model.bin, the tensor by tensor
value check) run on. worker/hooks.py closes the gate around the runner's
execute_model.

A lone read passes a closed gate: online, where reads come a few a second,
parking every read during every forward pass made each one 1.75x as long
and an adapter's first request 22-30 ms slower at the median, for nothing
(session 38). The burst the gate is for has many reads at once.

Invariants:
- only the engine thread closes the gate (worker/hooks.py), and it never
  reads or waits for a read while the gate is closed (the page decisions,
  which may, run before it closes). A read's part threads may park, so
  such a wait would deadlock: `pause` on the thread that closed the gate
  raises instead (a read's first checkpoint runs on its calling thread);
- elsewhere `pause` returns at once while the gate is open or fewer than
  `min_reads` (at least 2) reads are under way (`reading`), otherwise when
  one of these holds. A read woken by the gate's opening parks again if it
  finds it closed anew;
- a parked read keeps what it holds (its arena extent, its file): it is
  delayed, never failed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class ReadGate:
    def __init__(self, min_reads: int = 2) -> None:
        if min_reads < 2:
            raise ValueError(f"min_reads must be at least 2 (a lone read passes), got {min_reads}")
        self._min_reads = min_reads
        self._cond = threading.Condition(threading.Lock())
        self._closed_by: int | None = None  # the thread holding it closed
        self._reads = 0  # reads under way (`reading`)
        self.paused_s = 0.0  # the readers' time parked, summed over threads

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """Reads park at their next checkpoint until this block ends, while
        `min_reads` or more are under way."""
        with self._cond:
            self._closed_by = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self._closed_by = None
                self._cond.notify_all()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """One read, from its start to its end (its checkpoints, on any thread,
        lie inside)."""
        with self._cond:
            self._reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._reads -= 1
                self._cond.notify_all()  # the reads left may be too few to park

    def _parks(self) -> bool:
        """(Under _cond.) Whether a checkpoint waits."""
        return self._closed_by is not None and self._reads >= self._min_reads

    def pause(self) -> None:
        """A read's checkpoint: wait while the gate is closed and `min_reads`
        reads (this one among them) are under way."""
        if self._closed_by is None:  # unlocked: a stale view moves one checkpoint
            return
        if self._closed_by == threading.get_ident():
            raise RuntimeError("an adapter read on the engine thread inside its forward "
                               "pass, under the read gate it closed (it could deadlock)")
        t0 = time.perf_counter()
        with self._cond:
            if not self._parks():
                return
            self._cond.wait_for(lambda: not self._parks())
            self.paused_s += time.perf_counter() - t0


def read_gate_for(read_pause: str, read_pause_reads: int) -> ReadGate | None:
    """The gate of `--loraserve-read-pause` and `--loraserve-read-pause-reads`
    (None with 'off')."""
    return None if read_pause == "off" else ReadGate(read_pause_reads)
