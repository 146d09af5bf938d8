"""A host-tier reader process (worker/file_readers.py): reads pieces of
adapter files into the tier's shared-memory chunks and screens their values,
under a GIL of its own.

The engine starts it as `python -m vllm_loraserve.worker.reader_proc
ARGS_JSON`, inheriting a socket and the chunks' descriptors. It maps the
chunks, says "ready", then answers one request at a time: a file's read,
(path, file offset, chunk, offset in the chunk, spans, screen) -> ("ok",
[(bytes read, max|value| or None) per span]), or the error, as ("oserror",
errno, text, file name), ("memory",) or ("error", text). It splits each
read's spans over `threads` threads of its own (adapters/peft.py
`read_file_spans`: one file at a time, so one round trip, and one wait for the
engine's GIL, per adapter). It exits at the end of its socket: when the
engine closes it, or dies (the kernel closes it then; a read under way
finishes first). No torch here: it starts in a fraction of a second.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys
from concurrent.futures import Executor, ThreadPoolExecutor
from multiprocessing.connection import Connection

from vllm_loraserve.adapters.peft import read_file_spans


def read(views: list[memoryview], parts: Executor, path: str, start: int, chunk: int,
         offset: int, spans: list[tuple[int, int]], screen: str | None) -> tuple:
    """One request's reply."""
    try:
        view = views[chunk][offset:offset + max((hi for _, hi in spans), default=0)]
        return "ok", read_file_spans(path, start, view, spans, screen, parts)
    except OSError as e:  # its errno tells the tier a transient error
        return "oserror", e.errno, e.strerror, e.filename
    except MemoryError:  # transient too
        return ("memory",)
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"


def serve(conn: Connection, views: list[memoryview], parts: Executor) -> None:
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the engine closed its end
            return
        conn.send(read(views, parts, *request))


def main(args: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when readers stop
    views = []
    for fd, size in args["chunks"]:
        views.append(memoryview(mmap.mmap(fd, size)))
        os.close(fd)
    conn = Connection(args["conn"])
    conn.send(("ready",))
    with ThreadPoolExecutor(max(args["threads"] - 1, 1)) as parts:  # map_all's caller works too
        serve(conn, views, parts)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
