"""A host-tier reader process (worker/file_readers.py): reads pieces of
adapter files into the tier's shared-memory chunks and screens their values,
under a GIL of its own.

The engine starts it as `python -m vllm_loraserve.worker.reader_proc
ARGS_JSON`, inheriting a socket and the chunks' descriptors. It asks the
kernel to kill it when the engine dies, maps the chunks, says "ready", then
answers one request at a time: (path, file offset, chunk, offset in the
chunk, lo, hi, screen) -> ("ok", bytes read, max|value| or None), or the
error, as ("oserror", errno, text) or ("error", text). It exits when the
engine closes its socket. No torch here: it starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
from multiprocessing.connection import Connection

from vllm_loraserve.adapters.peft import read_span

_PR_SET_PDEATHSIG = 1


def serve(conn: Connection, views: list[memoryview]) -> None:
    while True:
        try:
            path, start, chunk, offset, lo, hi, screen = conn.recv()
        except EOFError:  # the engine closed its end
            return
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                got, top = read_span(fd, views[chunk][offset:offset + hi], start, lo, hi, screen)
            finally:
                os.close(fd)
            reply = ("ok", got, top)
        except OSError as e:  # its errno tells the tier a transient error
            reply = ("oserror", e.errno, str(e))
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


def main(args: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when readers stop
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the engine died before prctl took effect
        return
    views = []
    for fd, size in args["chunks"]:
        views.append(memoryview(mmap.mmap(fd, size)))
        os.close(fd)
    conn = Connection(args["conn"])
    conn.send(("ready",))
    serve(conn, views)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
