"""The host tier's file reads in processes of their own.

The tier's readers run in the engine's process: its threads read and
screened each adapter's file there, and shared the engine thread's GIL.
With 4 of them reading beside it, the engine thread's host time for a page
load grew 2-5x on an H200 host (benchmarks/e2e/load_host_time.py,
docs/benchmarks/e2e.md, session 30). Here the tier's arena is made of
shared-memory chunks (worker/cpu_lora/shm.py `SharedChunks`, pinned at
start-up as the arena's own chunks are) and `processes` reader processes
(worker/reader_proc.py) map them: a file is read and screened there, in
pieces, on `threads` threads of each process (adapters/peft.py
`read_span`), and the tier's threads only send its place and wait for the
answer. One request per file: each answer waits for the engine's GIL,
which the engine thread holds most of the time (with a request per 8 MB
piece, in session 30, the processes idled 86% of the time and the tier's
reads took 1.4x as long as in threads). Everything else of a read (the config and
the header, the checks against the pool's layout, the tier's bookkeeping)
stays in the engine's process.

Invariants: each process serves one file at a time, for the thread that
took it from the idle queue; a process that dies fails the read it held
with an I/O error (transient: the adapter is read again at its next
request) and a new one takes its place.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from vllm_loraserve.worker.cpu_lora.shm import SharedSegment

logger = logging.getLogger(f"vllm.{__name__}")

START_TIMEOUT_S = 60.0
# Threads a process splits its file over: 4 processes (--loraserve-read-threads)
# then read 8 pieces at once, as the threads mode's 4 readers and 4 part threads do.
THREADS = 2


class ReaderFailure(RuntimeError):
    """A reader process could not be started."""


@dataclass(eq=False)
class _Reader:
    proc: subprocess.Popen
    conn: Connection

    def stop(self) -> None:
        self.conn.close()  # it exits at end of file
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
                 threads: int = THREADS) -> None:
        if processes < 1:
            raise ValueError(f"reader processes must be at least 1, got {processes}")
        self._chunks, self._threads = list(chunks), threads
        # Chunks by start address (they never overlap): a lookup is one bisect.
        self._by_address = sorted((c.address, i) for i, c in enumerate(self._chunks))
        self._starts = [a for a, _ in self._by_address]
        self._all: list[_Reader] = []  # every live reader, for the finalizer
        self._idle: queue.SimpleQueue[_Reader] = queue.SimpleQueue()
        self._finalizer = weakref.finalize(self, _stop_all, self._all)
        self.respawns = 0  # readers that replaced one that died
        try:
            for _ in range(processes):
                self._idle.put(self._spawn())
        except BaseException:
            self.close()
            raise
        logger.info("loraserve: %d host-tier reader processes (pids %s) map the tier's %d "
                    "chunks", processes, [r.proc.pid for r in self._all], len(self._chunks))

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
        except (EOFError, OSError, ReaderFailure) as e:
            self._drop(reader)
            raise ReaderFailure(f"a host-tier reader process failed to start "
                                f"(exit code {proc.poll()}): {e}") from e
        return reader

    def _drop(self, reader: _Reader) -> None:
        reader.stop()
        self._all.remove(reader)

    def _locate(self, dest: torch.Tensor) -> tuple[int, int]:
        address, nbytes = dest.data_ptr(), dest.numel() * dest.element_size()
        i = bisect.bisect_right(self._starts, address) - 1
        chunk = self._by_address[i][1] if i >= 0 else -1
        if chunk < 0 or not self._chunks[chunk].contains(address, nbytes):
            raise ValueError("the reader processes read only into the host tier's chunks")
        return chunk, address - self._chunks[chunk].address

    def read_spans(self, path: str, start: int, dest: torch.Tensor,
                   spans: list[tuple[int, int]], screen: str | None
                   ) -> list[tuple[int, float | None]]:
        chunk, offset = self._locate(dest)
        if any(lo < 0 or hi > dest.numel() for lo, hi in spans):
            raise ValueError("a span reaches past its buffer")
        while True:  # all may be busy (a slow disk): wait, unless none is left
            try:
                reader = self._idle.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._all:
                    raise ReaderFailure("no host-tier reader process is left") from None
        try:
            reader.conn.send((path, start, chunk, offset, spans, screen))
            reply = reader.conn.recv()
        except (EOFError, OSError) as e:
            code = reader.proc.poll()
            self._drop(reader)
            try:
                reader = self._spawn()
                self.respawns += 1
            except ReaderFailure:
                logger.exception("loraserve: a host-tier reader process could not be replaced")
                raise
            raise OSError(errno.EIO, f"a host-tier reader process died (exit code {code}) "
                          f"while reading {path}") from e
        finally:
            if reader in self._all:
                self._idle.put(reader)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "oserror":
            raise OSError(reply[1], reply[2])
        raise RuntimeError(f"a host-tier reader process failed reading {path}: {reply[1]}")

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._all]

    def close(self) -> None:
        """Stop the processes (idempotent)."""
        self._finalizer()
