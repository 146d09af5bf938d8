"""A gate that parks the host tier's reads while the engine thread works
(`--loraserve-read-pause {forward,step}`).

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
value check) run on. `forward` closes the gate around the runner's
execute_model; `step` around the page decisions and loads before it too
(worker/hooks.py), where the engine thread reopens it (`opened`) for as
long as it waits for a read.

Invariants:
- only the engine thread closes the gate (worker/hooks.py), and it never
  reads or waits for a read while the gate is closed: its reads and waits
  for reads (the tier's `get`, `add` and `wait_for_a_read`, worker/host_tier.py)
  run inside `opened`, and RPCs between steps with the gate open. A
  read's part threads may park, so a read the engine thread waited for
  under a closed gate would never end;
- `pause` returns at once on the thread that closed the gate, and on any
  thread while it is open; otherwise when it opens;
- a parked read keeps what it holds (its arena extent, its file): it is
  delayed, never failed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class ReadGate:
    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._owner: int | None = None
        self._lock = threading.Lock()
        self.paused_s = 0.0  # the readers' time parked, summed over threads

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """Reads park at their next checkpoint until this block ends."""
        self._owner = threading.get_ident()
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()
            self._owner = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """The closing thread's wait for a read: reads run until this block
        ends, then the gate is closed again. On any other thread, or with the
        gate open (not closed, or within another `opened`), nothing changes."""
        if threading.get_ident() != self._owner or self._open.is_set():
            yield
            return
        self._open.set()
        try:
            yield
        finally:
            self._open.clear()

    def pause(self) -> None:
        """A read's checkpoint: wait while another thread holds the gate closed."""
        if self._open.is_set() or threading.get_ident() == self._owner:
            return
        t0 = time.perf_counter()
        self._open.wait()
        with self._lock:
            self.paused_s += time.perf_counter() - t0
