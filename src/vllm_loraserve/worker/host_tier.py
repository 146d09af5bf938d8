"""The pool's host tier: adapters in host memory, as their files hold them.

Each entry is one adapter's weights file data in one extent of the tier's
arena (worker/arena.py: allocated, and pinned on a GPU, once at start-up;
nothing is pinned while serving), read with one copy by the `read` callable
it is given (worker/paged_manager.py passes adapters/peft.py `read_weights`,
which checks the values in that buffer for NaN/Inf and overflow, plus the
pool's layout checks), so an adapter's files are read once per entry and a
device load is one host-to-device copy that never touches the disk.
Entries are evicted least recently used first when a read needs room; an
evicted adapter is read from disk again when next needed.

Reads run on `threads` background readers (`prefetch`, from the
scheduler's hints) or on the engine thread (`get`, for an adapter a step
loads that the tier does not hold; `add`, a runtime add_lora). Every other
method is for the engine thread alone.

- Entries the scheduler still needs (`keep`: adapters of waiting requests
  not yet in the device pool) and entries read since the last `report`
  (`fresh`: each finished read admits its requests at least once) are
  evicted only by a read on the engine thread, which must have its adapter.
  A prefetch starts only when `has_room` says the kept entries and the
  reads under way leave room for it; a background read that still finds no
  extent after evicting what it may gives up (`NoRoom`: no failure) and a
  later step's hint starts it again.
- Generations: a runtime add or remove of an adapter bumps its generation;
  a read started before commits nothing.
- Failures: a read that raises (other than `NoRoom`) marks its adapter
  failed with the reason, which `report` hands to the scheduler: weights
  the read refused (`BadWeights`: NaN/Inf, a scaling that overflows the
  serving dtype) say so, anything else says the files could not be read.
  A failure is sticky (no read until a runtime add or remove) unless
  `is_transient` says trying again may succeed (an I/O error, memory
  pressure): such a failure is in one `report` only, which fails the
  requests waiting for it, and the next request's hint reads it again.
  The same holds for a failed page load (`fail`, from worker/paged_manager.py).
- Reuse of an evicted extent: the engine thread may still be copying from
  an entry it took with `get` when a reader evicts it. Entries are marked
  with the epoch of their last `get`; `end_step` closes the epoch with a
  fence (the `fence` callable: CUDA events after the step's copies, or None
  when copies are synchronous), and an evicted extent returns to the arena
  only once the fence of its last use has completed. Only the engine
  thread closes an epoch, once it has issued the copies: a read that
  finds the memory held by the open epoch's uses alone raises
  `StepOverflow` rather than reuse it.

Invariants (`check`): `bytes_used` == the sum of the entries' extents;
the arena's live extents are exactly those of the entries, of the reads
holding one and of the evicted ones awaiting a fence, with no overlap.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from vllm_loraserve.adapters.peft import BadWeights, RawWeights
from vllm_loraserve.paging.layout import AdapterPlacement
from vllm_loraserve.paging.step import MAX_REMOVED_IDS, TRANSIENT_NOTE, PoolReport
from vllm_loraserve.worker.arena import Extent, PinnedArena

logger = logging.getLogger(f"vllm.{__name__}")

T = TypeVar("T")
Alloc = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class HostAdapter:
    """What the paged pool keeps per adapter (worker/paged_manager.py)."""

    name: str
    placement: AdapterPlacement
    scaling: float
    weights: RawWeights  # its data is a view of the entry's extent
    where: dict[str, tuple[int, str]]  # module path -> (layer, slice name), checked on read
    # paging/layout.py's pack table (--loraserve-pack triton), built by the reader
    pack_table: np.ndarray | None = field(default=None, compare=False)

    def layer_weights(self, layers: range, data: torch.Tensor | None = None
                      ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer of `layers`: slice name -> (A [r, in], B [out, r]),
        views of `data` (the file's bytes, e.g. copied to a device; default:
        the tier's own)."""
        names = [name for name, (layer, _) in self.where.items() if layer in layers]
        return by_layer(self.where, self.weights.tensors(data, names), layers)


def by_layer(where: dict[str, tuple[int, str]], items: Mapping[str, T], layers: range
             ) -> list[dict[str, T]]:
    """Per layer of `layers`: slice name -> the item of its module path
    (`where`: module path -> (layer, slice name); every item's layer is in
    `layers`)."""
    out: list[dict[str, T]] = [{} for _ in layers]
    for name, item in items.items():
        layer, short = where[name]
        out[layer - layers.start][short] = item
    return out


class Readable(Protocol):
    """What the tier needs of a request (vLLM's LoRARequest has it)."""

    lora_int_id: int
    lora_name: str


class Fence(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class NoRoom(Exception):
    """A background read found no extent without evicting kept entries."""


class StepOverflow(Exception):
    """An engine-thread read found the tier's memory held by the step's own
    uses alone (the step's adapters outgrow the tier): the caller issues the
    copies from the entries it took, calls `end_step`, and reads again."""


# A read that failed with one of these may well succeed if tried again: the
# files are fine, the system was not. EIO: a disk or network filesystem
# error; EAGAIN/EWOULDBLOCK, EINTR, EBUSY: a call to try again; ENOMEM,
# ENFILE, EMFILE: memory or open files short for now; ETIMEDOUT, ESTALE: a
# network filesystem's timeout or stale handle (a new read opens anew).
# Others (ENOENT, EACCES, EISDIR, ...) say the files are not servable.
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR,
                               errno.EBUSY, errno.ENOMEM, errno.ENFILE, errno.EMFILE,
                               errno.ETIMEDOUT, errno.ESTALE})


def is_transient(error: BaseException | None) -> bool:
    """Whether a failed read or page load may succeed if tried again, so its
    adapter is not failed for good: an OSError of `_TRANSIENT_ERRNOS`, or
    host or device memory that ran out (MemoryError, CUDA's
    OutOfMemoryError: memory frees as other loads and requests end), here
    or as the cause of the error raised (adapters/peft.py wraps OSErrors in
    AdapterError). Anything else (a malformed file, NaN/Inf weights, wrong
    shapes, a rank above the limit) fails again the same way: sticky."""
    while error is not None:
        if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)) or \
                isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
        error = error.__cause__
    return False


class AdapterTooLarge(Exception):
    """An adapter's file data exceeds the arena's chunk (no ValueError: the
    file readers turn those into "unreadable")."""


@dataclass
class _Entry(Generic[T]):
    value: T
    extent: Extent
    last_use: int = -1  # epoch of the last `get`; -1: never used by the engine


class HostTier(Generic[T]):
    def __init__(self, arena: PinnedArena, read: Callable[[Readable, Alloc], T], threads: int,
                 fence: Callable[[], Fence | None] = lambda: None,
                 on_read: Callable[[int, float], None] | None = None) -> None:
        """`read(request, alloc)` reads an adapter: `alloc(nbytes)` (once)
        gives it a uint8 buffer for the file data; it returns the entry.
        `on_read(lora id, seconds)` is told of each committed read."""
        self.arena = arena
        self._read_file = read
        self._fence = fence
        self._on_read = on_read
        # One intra-op thread per reader: the readers' only tensor op (copying
        # an adapter_model.bin) would otherwise start an OpenMP team of all
        # cores in every reader (benchmarks/e2e/read_path.py).
        self._readers = ThreadPoolExecutor(max_workers=threads,
                                           thread_name_prefix="loraserve-read",
                                           initializer=torch.set_num_threads, initargs=(1,))
        self._lock = threading.Condition(threading.Lock())
        self._entries: OrderedDict[int, _Entry[T]] = OrderedDict()  # LRU first
        self._bytes = 0
        # Background reads under way: lora id -> (future, bytes it will take).
        self._reading: dict[int, tuple[Future, int]] = {}
        self._held: set[Extent] = set()  # extents of reads not committed yet
        self._keep: frozenset[int] = frozenset()
        self._fresh: set[int] = set()
        self._generation: dict[int, int] = {}
        self._removed: OrderedDict[int, None] = OrderedDict()  # by `remove`, oldest first
        self._failed: dict[int, str] = {}
        self._transient: set[int] = set()  # failed ids reported once, then read again
        # Epochs of the engine thread's uses (see the module docstring).
        self._epoch, self._touched = 0, False
        self._fences: deque[tuple[int, Fence | None]] = deque()  # closed, not known done
        self._done_epoch = -1
        self._retired: list[tuple[Extent, int]] = []  # evicted, awaiting its fence

    # -- state --------------------------------------------------------------
    @property
    def budget(self) -> int:
        return self.arena.size

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, lora_id: int) -> bool:
        with self._lock:
            return lora_id in self._entries

    def failed_ids(self) -> set[int]:
        with self._lock:
            return set(self._failed)

    def state(self, lora_id: int) -> tuple[str, str | None]:
        """Where the adapter stands here: ("host", None) in the tier,
        ("reading", None) a background read under way, ("failed", why), or
        ("absent", None)."""
        with self._lock:
            self._forget_finished_reads()
            if lora_id in self._entries:
                return "host", None
            if lora_id in self._reading:
                return "reading", None
            if lora_id in self._failed:
                return "failed", self._failed[lora_id]
            return "absent", None

    def take_transient_failure(self, lora_id: int) -> str | None:
        """The adapter's transient failure, if one is recorded, forgotten here
        (its next read is a retry; no report carries it)."""
        with self._lock:
            if lora_id not in self._transient:
                return None
            self._transient.discard(lora_id)
            return self._failed.pop(lora_id)

    def report(self) -> PoolReport:
        """The adapters in the tier, or read since the last report even if
        evicted since (each finished read admits its requests at least once:
        no livelock when the tier is smaller than the reads under way), and
        the failures: transient ones in this report only (worker/hooks.py
        puts every report it builds on a step's output, so the scheduler
        sees each once)."""
        with self._lock:
            ready, self._fresh = frozenset(self._entries) | self._fresh, set()
            report = PoolReport(ready, dict(self._failed), frozenset(self._transient))
            for lora_id in self._transient:
                del self._failed[lora_id]
            self._transient.clear()
            return report

    def set_keep(self, keep: Collection[int]) -> None:
        with self._lock:
            self._keep = frozenset(keep)

    def has_room(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` fits beside the kept (and fresh)
        entries and the reads under way, evicting only the others. An empty
        tier always has room (the arena's chunks hold any servable adapter)."""
        with self._lock:
            self._forget_finished_reads()
            return self._has_room(self.arena.round(nbytes))

    def _forget_finished_reads(self) -> None:
        """Drop the reads whose future is done (their entry or failure is
        recorded by then): a finished read reserves no room and does not make
        a new read of its adapter look under way. The future's being done is
        the test, not a done callback, which a loaded machine may run late.
        Under the lock, before any look at `_reading`'s reads under way."""
        for lora_id in [i for i, (f, _) in self._reading.items() if f.done()]:
            del self._reading[lora_id]

    def _has_room(self, size: int) -> bool:
        spare = self._keep | self._fresh
        kept = sum(e.extent.size for i, e in self._entries.items() if i in spare)
        reserved = sum(n for _, n in self._reading.values())
        return kept + reserved + size <= self.arena.size or kept + reserved == 0

    # -- reads ----------------------------------------------------------------
    def prefetch(self, request: Readable, nbytes: int) -> bool:
        """Start reading an adapter (about `nbytes`) in the background, if it
        is not in the tier, read, or failed, and there is room for it."""
        lora_id = request.lora_int_id
        size = self.arena.round(nbytes)
        with self._lock:
            self._forget_finished_reads()
            if lora_id in self._entries or lora_id in self._reading or \
                    lora_id in self._failed or not self._has_room(size):
                return False
            self._reading[lora_id] = self._readers.submit(self._read, request, True, True), size
        return True

    def get(self, request: Readable) -> tuple[T, bool]:
        """The adapter's entry, and whether the tier had it: from the tier,
        from a background read under way, or read now. It is in use until
        `end_step`; a failed read raises, as does a read with no room beside
        this step's uses (`StepOverflow`: nothing is recorded)."""
        lora_id = request.lora_int_id
        with self._lock:
            if lora_id in self._entries:
                return self._use(lora_id), True
            reading = self._reading.get(lora_id)
        if reading is not None:
            try:
                reading[0].result()
            except NoRoom:
                pass  # read it here
            with self._lock:
                if lora_id in self._entries:
                    return self._use(lora_id), False
        return self._read(request, background=False, record_failure=True, use=True), False

    def add(self, request: Readable) -> T:
        """Runtime add_lora (first load or in-place reload): read now. A
        failure is this call's error only; reads of an earlier version still
        under way commit nothing. An id added back after a remove is live
        again: `drop_removed` no longer takes it."""
        self._new_generation(request.lora_int_id)
        with self._lock:
            self._removed.pop(request.lora_int_id, None)
        return self._read(request, background=False, record_failure=False)

    def remove(self, lora_id: int) -> bool:
        self._new_generation(lora_id)
        with self._lock:
            self._removed[lora_id] = None
            while len(self._removed) > MAX_REMOVED_IDS:
                self._removed.popitem(last=False)
            entry = self._entries.pop(lora_id, None)
            if entry is not None:
                self._drop(entry)
            return entry is not None

    def drop_removed(self, resident: Collection[int]) -> None:
        """Entries of removed adapters go once neither a page (`resident`),
        a waiting request (`keep`) nor an unreported read needs them: a
        request admitted before the remove may have read its adapter back."""
        with self._lock:
            for lora_id in [i for i in self._entries if i in self._removed]:
                if lora_id not in resident and lora_id not in self._keep | self._fresh:
                    self._drop(self._entries.pop(lora_id))

    def fail(self, lora_id: int, reason: str, transient: bool = False) -> bool:
        """Mark an adapter failed (its load failed after the read; `transient`:
        `is_transient` of its error); whether no failure was recorded for it
        (a transient one is forgotten once reported)."""
        with self._lock:
            return self._record_failure(lora_id, reason, transient)

    def _record_failure(self, lora_id: int, reason: str, transient: bool) -> bool:
        """(Under _lock.) The first failure's reason is kept, unless a sticky
        one follows a transient one: the adapter is failed for good then."""
        first = lora_id not in self._failed
        if transient and first:
            self._failed[lora_id] = reason + TRANSIENT_NOTE
            self._transient.add(lora_id)
        elif not transient and (first or lora_id in self._transient):
            self._failed[lora_id] = reason
            self._transient.discard(lora_id)
        return first

    def wait_for_a_read(self, timeout: float) -> bool:
        """Wait until a background read finishes, at most `timeout` seconds;
        whether reads are still under way (until their future is done)."""
        with self._lock:
            self._forget_finished_reads()
            reading = [f for f, _ in self._reading.values()]
        if reading:
            wait(reading, timeout=timeout, return_when=FIRST_COMPLETED)
        return any(not f.done() for f in reading)

    def end_step(self) -> None:
        """The engine thread's uses so far are all issued: close their epoch."""
        with self._lock:
            self._close_epoch()
            self._reap()

    def shutdown(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)

    def _new_generation(self, lora_id: int) -> None:
        with self._lock:
            self._generation[lora_id] = self._generation.get(lora_id, 0) + 1
            self._failed.pop(lora_id, None)
            self._transient.discard(lora_id)
            self._reading.pop(lora_id, None)

    def _read(self, request: Readable, background: bool, record_failure: bool,
              use: bool = False) -> T:
        """Disk -> tier. `background`: on a reader (gives up rather than
        evict kept entries); `use`: the engine thread uses it this step."""
        lora_id = request.lora_int_id
        with self._lock:
            generation = self._generation.get(lora_id, 0)
        extent: Extent | None = None

        def alloc(nbytes: int) -> torch.Tensor:
            nonlocal extent
            if extent is not None:
                raise RuntimeError("a read takes one buffer")
            extent = self._allocate(nbytes, background)
            return self.arena.view(extent, nbytes)

        t0 = time.perf_counter()
        try:
            value = self._read_file(request, alloc)
            if extent is None:
                raise RuntimeError("the read returned without a buffer")
        except (NoRoom, StepOverflow):
            raise  # no failure: the read is tried again
        except Exception as e:
            # Adapter files are input: whatever they raise fails this adapter only.
            reason = str(e) if isinstance(e, BadWeights) else \
                f"its files could not be read: {type(e).__name__}: {e}"
            transient = is_transient(e)
            with self._lock:
                if extent is not None:
                    self._release(extent)
                record = record_failure and self._generation.get(lora_id, 0) == generation
                if record:
                    self._record_failure(lora_id, reason, transient)
            if record:
                logger.error("vllm-loraserve: adapter %s (id %d) cannot be served: %s%s",
                             request.lora_name, lora_id, reason,
                             TRANSIENT_NOTE if transient else "")
            raise
        with self._lock:
            self._held.discard(extent)
            self._lock.notify_all()
            entry = _Entry(value, extent)
            if self._generation.get(lora_id, 0) == generation:
                old = self._entries.pop(lora_id, None)
                if old is not None:
                    self._drop(old)
                self._entries[lora_id] = entry
                self._bytes += extent.size
                if lora_id not in self._transient:
                    # A transient failure is reported even so: a load that
                    # failed may have run its requests without the adapter.
                    self._failed.pop(lora_id, None)
                self._fresh.add(lora_id)
                if use:
                    self._use(lora_id)
            else:  # overtaken by a runtime add or remove
                if use:  # yet the step copies from it: free it after the step
                    self._touch(entry)
                self._drop(entry, counted=False)
        if self._on_read is not None:
            self._on_read(lora_id, time.perf_counter() - t0)
        return value

    # -- the arena (under _lock) ------------------------------------------------
    def _allocate(self, nbytes: int, background: bool) -> Extent:
        """An extent for a read, evicting LRU entries (kept ones last, and
        only for a read on the engine thread) until one fits."""
        size = self.arena.round(nbytes)
        if size > self.arena.chunk_bytes:
            raise AdapterTooLarge(f"its weights take {nbytes} bytes, more than the host tier's "
                             f"largest buffer ({self.arena.chunk_bytes} bytes: an adapter of "
                             "the largest rank on every module, in float32)")
        while True:
            fence = None
            with self._lock:
                self._reap()
                extent = self.arena.alloc(size)
                if extent is not None:
                    self._held.add(extent)
                    return extent
                if self._evict(self._keep | self._fresh):
                    continue
                if background:
                    raise NoRoom(f"no room for {nbytes} bytes beside the entries waiting "
                                 "requests need")
                if self._evict(()):
                    continue
                # What is left is memory not released yet: copies still
                # running (wait for the oldest closed epoch's fence), this
                # step's own uses, whose copies may not be issued yet (only
                # the caller can tell; it frees them faster than a disk read
                # finishes), and reads under way.
                if self._fences:
                    fence = self._fences[0][1]
                elif self._touched:
                    raise StepOverflow(f"no room for {nbytes} bytes beside this step's "
                                       "adapters: issue their copies, end the step, read again")
                elif self._held:
                    self._lock.wait(timeout=0.1)
                    continue
                else:  # an empty arena holds any extent up to a chunk
                    raise AssertionError(f"no extent of {size} bytes in an empty arena")
            if fence is not None:
                fence.synchronize()  # outside the lock: readers go on

    def _evict(self, spare: Collection[int]) -> bool:
        """Evict the least recently used entry not in `spare`; False if none."""
        for lora_id in self._entries:
            if lora_id not in spare:
                self._drop(self._entries.pop(lora_id))
                return True
        return False

    def _drop(self, entry: _Entry[T], counted: bool = True) -> None:
        """An entry left the tier (`counted`) or never entered it: its extent
        goes back to the arena once the engine thread is done with it."""
        if counted:
            self._bytes -= entry.extent.size
        if entry.last_use > self._done_epoch:
            self._retired.append((entry.extent, entry.last_use))
        else:
            self.arena.free(entry.extent)

    def _release(self, extent: Extent) -> None:
        """A failed read's extent (never used)."""
        self._held.discard(extent)
        self.arena.free(extent)
        self._lock.notify_all()

    def _use(self, lora_id: int) -> T:
        self._entries.move_to_end(lora_id)
        entry = self._entries[lora_id]
        self._touch(entry)
        return entry.value

    def _touch(self, entry: _Entry[T]) -> None:
        entry.last_use = self._epoch
        self._touched = True

    def _close_epoch(self) -> None:
        if self._touched:
            self._fences.append((self._epoch, self._fence()))
            self._epoch += 1
            self._touched = False

    def _reap(self) -> None:
        """Free the evicted extents whose last use's fence has completed."""
        while self._fences and (self._fences[0][1] is None or self._fences[0][1].query()):
            self._done_epoch = self._fences.popleft()[0]
        if self._retired:
            waiting = []
            for extent, epoch in self._retired:
                if epoch <= self._done_epoch:
                    self.arena.free(extent)
                else:
                    waiting.append((extent, epoch))
            self._retired = waiting

    def check(self) -> None:
        """Assert the invariants (for tests)."""
        with self._lock:
            self.arena.check()
            entries = [e.extent for e in self._entries.values()]
            assert self._bytes == sum(e.size for e in entries)
            owned = entries + list(self._held) + [e for e, _ in self._retired]
            assert len(set(owned)) == len(owned)
            assert set(owned) == self.arena._live
