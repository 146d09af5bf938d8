"""A CPU worker process: one core, one intra-op thread, jobs from the
control segment (control.py), rows and results in the io segment, weights
read where they lie.

The engine starts it as `python -m vllm_loraserve.worker.cpu_lora.proc
ARGS_JSON`, inheriting the segments' descriptors and two doorbells
(doorbell.py). It pins itself to its core, asks the kernel to kill it if
the engine dies, maps the segments, profiles its core (split.py) and
publishes the speed, which tells the engine it is up. Then, per job: wait
for its doorbell (the engine posted a descriptor; idle workers sleep here,
in the kernel), spin on the READY flag of the descriptor's `ready_job` (set
by the engine, or by the GPU's copy of the rows; a spin of `spin_s`, then
short sleeps), compute its rows' share, store DONE. A failure stores its
text and the job in ERROR and FAILED, then DONE: nobody waits for a job
that will not come. It exits on SHUTDOWN, or when its parent is gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

import torch

from vllm_loraserve.worker.cpu_lora.control import (
    DTYPES,
    SHUTDOWN,
    Control,
    ControlLayout,
    strided,
)
from vllm_loraserve.worker.cpu_lora.doorbell import Doorbell
from vllm_loraserve.worker.cpu_lora.shm import SharedSegment
from vllm_loraserve.worker.cpu_lora.split import profile_rows_per_s

IDLE_CHECK_S = 0.5  # how often an idle worker looks for SHUTDOWN or a dead parent
READY_SLEEP_S = 50e-6
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker is started with (JSON on its command line, once)."""

    index: int
    core: int
    workers: int
    depth: int
    control: tuple[int, int]  # segment (inherited fd, size)
    io: tuple[int, int]
    weights: tuple[tuple[int, int], ...]
    go_fd: int  # its doorbell
    done_fd: int  # the engine's
    spin_s: float
    ready_timeout_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        raw = json.loads(text)
        raw["control"], raw["io"] = tuple(raw["control"]), tuple(raw["io"])
        raw["weights"] = tuple(tuple(w) for w in raw["weights"])
        return cls(**raw)


def _wait_ready(flags, index: int, job: int, spin_s: float, timeout_s: float) -> bool:
    start = time.monotonic()
    while flags[index] < job:
        now = time.monotonic()
        if now - start > timeout_s:
            return False
        if now - start > spin_s:
            time.sleep(READY_SLEEP_S)
    return True


def _compute(d, index: int, segments: list[SharedSegment]) -> None:
    start, end = (int(v) for v in d["rows"][index])
    if end <= start:
        return
    n, k, m, r = (int(d[f]) for f in ("n", "in_features", "out_features", "rank"))
    io = segments[0].bytes
    x = strided(io, int(d["x_off"]), (n, k), (k, 1), DTYPES[int(d["x_dtype"])])[start:end]
    a = strided(segments[int(d["a_seg"])].bytes, int(d["a_off"]), (r, k),
                (int(d["a_s0"]), int(d["a_s1"])), DTYPES[int(d["a_dtype"])])
    bt = strided(segments[int(d["bt_seg"])].bytes, int(d["bt_off"]), (r, m),
                 (int(d["bt_s0"]), int(d["bt_s1"])), DTYPES[int(d["bt_dtype"])])
    y_dtype = DTYPES[int(d["y_dtype"])]
    y = strided(io, int(d["y_off"]), (n, m), (m, 1), y_dtype)[start:end]
    h = x.float() @ a.float().T
    h.mul_(float(d["scaling"]))
    if y_dtype == torch.float32:
        torch.matmul(h, bt.float(), out=y)
    else:
        y.copy_(h @ bt.float())


def main(args: WorkerArgs) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the engine died before prctl took effect
        return
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    go, done = Doorbell(args.go_fd), Doorbell(args.done_fd)
    control = SharedSegment.attach(*args.control)
    segments = [SharedSegment.attach(*args.io)] + [SharedSegment.attach(*w) for w in args.weights]
    lay = ControlLayout(args.workers, args.depth)
    ctl = Control(lay, control.bytes)
    flags = ctl.flags
    ctl.speeds[args.index] = profile_rows_per_s()  # publishes "started"
    job = 0
    while not flags[SHUTDOWN]:
        if not go.wait(IDLE_CHECK_S):
            if os.getppid() != parent:
                break
            continue
        if flags[SHUTDOWN]:
            break
        job += 1
        d = ctl.jobs[job % lay.depth]
        try:
            if int(d["job"]) != job:
                raise RuntimeError(f"slot {job % lay.depth} holds job {int(d['job'])}, "
                                   f"expected job {job}")
            ready = int(d["ready_job"])
            if not _wait_ready(flags, ctl.ready_index(ready), ready, args.spin_s,
                               args.ready_timeout_s):
                raise TimeoutError(f"the rows of job {job} were not ready within "
                                   f"{args.ready_timeout_s} s")
            _compute(d, args.index, segments)
        except Exception as exc:  # told to the engine, which raises it
            ctl.set_message(args.index, f"{type(exc).__name__}: {exc}")
            flags[lay.error0 + args.index] = job
            flags[ctl.failed_index(job)] = job
        notify = bool(d["notify"])  # read before DONE: the slot may be reused after it
        flags[lay.done0 + args.index] = job
        if notify:
            done.ring()


if __name__ == "__main__":
    main(WorkerArgs.from_json(sys.argv[1]))
