"""The host tier's file reads in processes of their own (experimental).

The tier's readers run in the engine's process: its threads read and
screened each adapter's file there, and shared the engine thread's GIL.
With 4 of them reading beside it, the engine thread's host time for a page
load grew 2.5-6x on an H200 host (benchmarks/e2e/load_host_time.py,
docs/benchmarks/e2e.md, session 30). Here the tier's arena is made of
shared-memory chunks (worker/cpu_lora/shm.py `SharedChunks`, pinned at
start-up as the arena's own chunks are) and `processes` reader processes
(worker/reader_proc.py) map them: a file is read and screened there, in
pieces, on `threads` threads of each process (adapters/peft.py
`read_span`), and the tier's threads only send its place and wait for the
answer. One request per file: each answer waits for the engine's GIL,
which the engine thread holds most of the time (with a request per 8 MB
piece, in session 30, the processes idled 86% of the time and the tier's
reads took 1.4x as long as in threads). Everything else of a read (the
config and the header, the checks against the pool's layout, the tier's
bookkeeping) stays in the engine's process.

Invariants:
- each process serves one file at a time, for the thread that took it from
  the idle queue, and goes back to the queue only after its answer was
  read: a read that ends otherwise (the process died, did not answer
  within `timeout_s` plus the file's bytes at `MIN_RATE`, or the waiting
  thread was interrupted) kills it, so no later read takes an old answer or
  finds its buffer still being written, and a new one takes its place;
- such a read fails with an I/O error (transient: the adapter is read again
  at its next request), as does one when no process is left, because a
  new one could not be started: an adapter's failure says something about
  its files only where the process read them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from vllm_loraserve.worker.cpu_lora.shm import SegmentIndex, SharedSegment

logger = logging.getLogger(f"vllm.{__name__}")

START_TIMEOUT_S = 60.0
# A read's time limit: this, plus its bytes at MIN_RATE (a slow network disk).
READ_TIMEOUT_S = 60.0
MIN_RATE = 50e6
SLOW_READ_S = 5.0  # a read still under way after this is logged, once
POLL_S = 0.5
# Threads a process splits its file over: 4 processes (--loraserve-read-threads)
# then read 8 pieces at once, as the threads mode's 4 readers and 4 part threads do.
THREADS = 2


class ReaderFailure(OSError):
    """A reader process died, hung or could not be started (errno EIO:
    transient, worker/host_tier.py `is_transient`)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass(eq=False)
class _Reader:
    proc: subprocess.Popen
    conn: Connection

    def stop(self, kill: bool = False) -> None:
        """Close its socket (it exits at end of file), or kill it first."""
        if kill:
            self.proc.kill()
        self.conn.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _stop_all(readers: list[_Reader]) -> None:
    for r in readers:
        r.stop()
    readers.clear()


class ReaderProcesses:
    """adapters/peft.py `SpanFiles` over `processes` reader processes that
    map `chunks` (the arena's segments, which stay open while this lives)."""

    def __init__(self, chunks: Sequence[SharedSegment], processes: int,
                 threads: int = THREADS, timeout_s: float = READ_TIMEOUT_S) -> None:
        if processes < 1:
            raise ValueError(f"reader processes must be at least 1, got {processes}")
        self._chunks, self._threads, self._timeout_s = list(chunks), threads, timeout_s
        self._index = SegmentIndex(self._chunks)
        self._all: list[_Reader] = []  # every live reader, for the finalizer
        self._idle: queue.SimpleQueue[_Reader] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._count = 0  # readers alive or being replaced (under _lock)
        self.respawns = 0  # readers that replaced one that died, hung or was interrupted
        self.reads = 0  # files read
        self._finalizer = weakref.finalize(self, _stop_all, self._all)
        try:
            for _ in range(processes):
                self._idle.put(self._spawn())
                self._count += 1
        except BaseException:
            self.close()
            raise
        logger.info("loraserve: %d host-tier reader processes (pids %s) map the tier's %d "
                    "chunks", processes, self.pids, len(self._chunks))

    def _spawn(self) -> _Reader:
        ours, theirs = socket.socketpair()
        fds = [c.fd for c in self._chunks]
        args = json.dumps({"conn": theirs.fileno(), "threads": self._threads,
                           "chunks": [(c.fd, c.size) for c in self._chunks]})
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_loraserve.worker.reader_proc", args],
                pass_fds=(theirs.fileno(), *fds), stdin=subprocess.DEVNULL,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader = _Reader(proc, Connection(ours.detach()))
        self._all.append(reader)
        try:
            if not reader.conn.poll(START_TIMEOUT_S):
                raise ReaderFailure(f"a host-tier reader process did not start within "
                                    f"{START_TIMEOUT_S} s")
            if reader.conn.recv() != ("ready",):
                raise ReaderFailure("a host-tier reader process started wrongly")
        except BaseException as e:
            self._all.remove(reader)
            reader.stop(kill=True)
            if isinstance(e, (EOFError, OSError)):
                raise ReaderFailure(f"a host-tier reader process failed to start (exit code "
                                    f"{proc.returncode}): {e}") from e
            raise
        return reader

    def _replace(self, reader: _Reader) -> None:
        """Kill `reader` and start another in its place (one fewer if that fails)."""
        self._all.remove(reader)
        reader.stop(kill=True)
        try:
            self._idle.put(self._spawn())
            self.respawns += 1
        except BaseException as e:
            with self._lock:
                self._count -= 1
            logger.exception("loraserve: a host-tier reader process could not be replaced "
                             "(%d left)", self._count)
            if isinstance(e, Exception) and not isinstance(e, ReaderFailure):
                # e.g. Popen's own OSError, which must not read as the adapter's
                raise ReaderFailure(f"a host-tier reader process could not be replaced: "
                                    f"{type(e).__name__}: {e}") from e
            raise

    def _take(self) -> _Reader:
        while True:  # all may be busy (a slow disk): wait, unless none is left
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if not self._count:
                        raise ReaderFailure("no host-tier reader process is left") from None

    def _answer(self, reader: _Reader, path: str, nbytes: int) -> tuple:
        start = time.monotonic()
        limit, logged = self._timeout_s + nbytes / MIN_RATE, False
        while not reader.conn.poll(POLL_S):
            waited = time.monotonic() - start
            if reader.proc.poll() is not None:
                raise ReaderFailure(f"a host-tier reader process died (exit code "
                                    f"{reader.proc.returncode}) while reading {path}")
            if waited > limit:
                raise ReaderFailure(f"a host-tier reader process did not read {path} "
                                    f"({nbytes} bytes) within {limit:.0f} s")
            if waited > SLOW_READ_S and not logged:
                logged = True
                logger.warning("loraserve: host-tier reader process %d has read %s for "
                               "%.0f s", reader.proc.pid, path, waited)
        return reader.conn.recv()

    def _locate(self, dest: torch.Tensor) -> tuple[int, int]:
        found = self._index.find(dest.data_ptr(), dest.numel() * dest.element_size())
        if found is None:
            raise ValueError("the reader processes read only into the host tier's chunks")
        return found

    def read_spans(self, path: str, start: int, dest: torch.Tensor,
                   spans: list[tuple[int, int]], screen: str | None
                   ) -> list[tuple[int, float | None]]:
        chunk, offset = self._locate(dest)
        if any(lo < 0 or hi > dest.numel() for lo, hi in spans):
            raise ValueError("a span reaches past its buffer")
        reader = self._take()
        try:
            reader.conn.send((path, start, chunk, offset, spans, screen))
            reply = self._answer(reader, path, sum(hi - lo for lo, hi in spans))
        except BaseException as e:
            self._replace(reader)
            if isinstance(e, (EOFError, OSError)) and not isinstance(e, ReaderFailure):
                raise ReaderFailure(f"a host-tier reader process failed while reading "
                                    f"{path}: {type(e).__name__}: {e}") from e
            raise
        self._idle.put(reader)
        self.reads += 1
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "oserror":
            raise OSError(*reply[1:])
        if reply[0] == "memory":
            raise MemoryError(f"a host-tier reader process ran out of memory reading {path}")
        raise RuntimeError(f"a host-tier reader process failed reading {path}: {reply[1]}")

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._all]

    def close(self) -> None:
        """Stop the processes (idempotent)."""
        self._finalizer()
