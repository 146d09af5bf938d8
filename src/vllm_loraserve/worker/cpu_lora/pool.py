"""CpuWorkerPool: the engine's side of the CPU workers (Toppings §4.2).

N processes (proc.py), started once, each pinned to its own core, compute
LoRA deltas y = ((x @ a.T) * scaling) @ bt in fp32 over their share of the
rows (split.py, from the start-up profile). Nothing on the data path is
pickled or sent over a socket: rows go in and results come out through the
io segment, jobs through the control segment (control.py), weights are read
where they lie, and the only messages are doorbell rings (eventfds, OS
semaphores: doorbell.py).

Two ways in:
- `delta(x, a, bt, scaling)`: the host writes the rows, posts the job and
  waits for it (cpu-assist where the CUDA op is missing).
- `enqueue(x, blocks, out)`: a batch of deltas over one set of rows (a
  layer's cold adapters x the module's slices: one `Block` each), all on
  x's device. On CUDA, on the current stream with the csrc/ op: the GPU
  copies the rows into the io segment and sets one READY flag for the
  batch, the workers spin on it, the GPU waits on their DONE flags, then
  copies the results back in one copy; the host never waits on the stream
  (needs `pin=True` and the op). On the CPU the same calls run on
  assist_ops.HostOps, whose waits are the host's. Batches run in order; the
  io segment holds one batch's rows and results, which the stream order
  makes safe (a batch's rows are written after the previous batch's wait).
  Each job's failure is read with `failure(jobs)` once the stream passed it.
  Do not call `delta` on a CUDA pool while enqueued batches may be pending
  on a stream (it would reuse the io segment before their copy back).

Scaling: `bt` is B transposed as the adapter's files hold it (unscaled), and
the pool applies `scaling` (alpha / r) itself. A Bt read from the device
pages (paging/layout.py) already holds scaling * B^T: pass scaling=1.0.

Weights without copies: pass the segments the host tier's arena lives in
(`weights`; shm.SharedChunks makes an arena's chunks such segments). An `a`
or `bt` that lies within one of them is read in place, at any strides (a
view of an adapter's lora_B as B^T included). Its bytes must not change
until the job is done: `delta` returning, or for `enqueue` the stream
passing the wait (the host tier frees an extent only after the step's fence,
which covers it). Other weights are copied into the io segment's staging
area for `delta` (counted in `stats.staged_bytes`) and refused by `enqueue`.

Failures: a worker's exception fails its job (the pool goes on): `delta`
and `wait` raise it (`AssistError` with its text), `failure(jobs)` returns
it for enqueued jobs. A worker that dies, or a job not done within
`timeout_s`, breaks the pool: that call and every later one raise
`WorkerFailure`. `close()` stops the workers (SHUTDOWN, then kill after a
grace period) and unmaps everything. The segments have no names (shm.py):
nothing is left behind even if the engine dies, and the workers, which the
kernel kills with their engine (PR_SET_PDEATHSIG), go with it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_loraserve.worker import assist_ops
from vllm_loraserve.worker.cpu_lora.control import (
    DTYPE_CODE,
    SHUTDOWN,
    TIMED_OUT,
    Control,
    ControlLayout,
    strided,
)
from vllm_loraserve.worker.cpu_lora.cores import assist_cores, shares_vllm_cores
from vllm_loraserve.worker.cpu_lora.doorbell import Doorbell
from vllm_loraserve.worker.cpu_lora.proc import WorkerArgs
from vllm_loraserve.worker.cpu_lora.shm import SegmentIndex, SharedSegment
from vllm_loraserve.worker.cpu_lora.split import split_rows

logger = logging.getLogger(f"vllm.{__name__}")

POLL_S = 0.01  # how long a host wait sleeps before it looks at the workers' health
STOP_GRACE_S = 2.0  # a worker finishes its job before it sees SHUTDOWN
LOST_MESSAGE = " (its message gave way to the worker's later failure)"
RELEASED = 1 << 62  # the DONE flags of an abandoned pool: past any job


@dataclass(frozen=True)
class CpuPoolConfig:
    workers: int = 0
    """Worker processes; 0: what this machine can spare beside vLLM (cores.py)."""
    cores: tuple[int, ...] = ()
    """Explicit cores, one worker each (overrides `workers` and the rule)."""
    gpu_workers: int = 1
    """GPU worker processes of vLLM on this node (the default rule divides spare cores)."""
    local_rank: int = 0
    """This engine worker's rank among them (which slice of spare cores is its own)."""
    read_threads: int = 4
    """The host tier's reader threads per GPU worker (cores the rule leaves to vLLM)."""
    max_rows: int = 2048
    """Rows per job: the io segment's size; longer inputs run as several jobs."""
    max_in: int = 4096
    """Largest input features (x's columns)."""
    max_out: int = 4096
    """Largest output features (y's columns)."""
    max_rank: int = 256
    """Largest rank of weights staged (copied) for `delta` because they lie outside `weights`."""
    min_rows: int = 16
    """Fewest rows worth a worker: a job of n rows uses the n // min_rows fastest workers."""
    depth: int = 4096
    """Jobs posted ahead of the workers (the descriptor ring): a step's enqueued deltas
    (layers x cold adapters x slices); a job beyond it makes the host wait for the one
    `depth` earlier."""
    timeout_s: float = 30.0
    """A job not done within this breaks the pool (host waits; workers' ready waits; the
    device wait, which then records the job in TIMED_OUT and lets the stream go on)."""
    spin_s: float = 0.002
    """How long a worker spins on a READY flag before it polls with 50 us sleeps."""
    start_timeout_s: float = 120.0
    """Start-up (spawn, imports, profile) of all workers."""

    def __post_init__(self) -> None:
        for name in ("workers", "gpu_workers", "read_threads", "max_rows", "max_in", "max_out",
                     "max_rank", "min_rows", "depth"):
            value = getattr(self, name)
            low = 0 if name in ("workers", "read_threads") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"CpuPoolConfig.{name} must be an integer >= {low}, "
                                 f"got {value!r}")
        if not 0 <= self.local_rank < self.gpu_workers:
            raise ValueError(f"local_rank {self.local_rank} of {self.gpu_workers} GPU workers")
        if min(self.timeout_s, self.start_timeout_s) <= 0 or self.spin_s < 0:
            raise ValueError("timeouts must be positive and spin_s >= 0")


class AssistError(RuntimeError):
    """A worker failed one job (the pool goes on)."""


class WorkerFailure(RuntimeError):
    """A worker died or a job timed out: the pool is unusable."""


@dataclass
class PoolStats:
    jobs: int = 0
    rows: int = 0
    staged_bytes: int = 0  # weights copied into the io segment (zero when they lie in `weights`)


@dataclass(frozen=True)
class Block:
    """One job of an `enqueue` batch: out[start:end, col:col + m] =
    ((x[start:end] @ a.T) * scaling) @ bt, for a [r, in] and bt [r, m] lying
    in the pool's weight segments."""

    start: int
    end: int
    col: int
    a: torch.Tensor
    bt: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class _Loc:
    seg: int
    off: int
    s0: int
    s1: int
    dtype: int


def _stop(procs: list[subprocess.Popen], bells: list[Doorbell], flags, segments) -> None:
    """Stop the workers, close the bells, unmap (the finalizer: holds no pool)."""
    flags[SHUTDOWN] = 1
    for bell in bells:
        if bell.fd >= 0:
            bell.ring()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(STOP_GRACE_S)
    for bell in bells:
        bell.close()
    for segment in segments:
        segment.close()


class CpuWorkerPool:
    def __init__(self, config: CpuPoolConfig | None = None,
                 weights: Sequence[SharedSegment] = (), pin: bool = False) -> None:
        self.config = cfg = config or CpuPoolConfig()
        self.cores = list(cfg.cores) or assist_cores(cfg.workers, cfg.gpu_workers,
                                                     cfg.local_rank, cfg.read_threads)
        n = len(self.cores)
        self.layout = ControlLayout(n, cfg.depth)
        self._y_off = cfg.max_rows * cfg.max_in * 4
        self._stage_off = self._y_off + cfg.max_rows * cfg.max_out * 4
        io_bytes = self._stage_off + cfg.max_rank * (cfg.max_in + cfg.max_out) * 4
        self._control_seg = SharedSegment.create(self.layout.nbytes, "assist-control")
        self._io = SharedSegment.create(io_bytes, "assist-io")
        # Plain processes, not multiprocessing: vLLM's workers are daemonic
        # and may not have multiprocessing children; nothing is pickled.
        self._go = [Doorbell() for _ in range(n)]
        self._done = Doorbell()
        self._procs: list[subprocess.Popen] = []
        self.ctl = Control(self.layout, self._control_seg.bytes)
        self._finalizer = weakref.finalize(
            self, _stop, self._procs, [*self._go, self._done], self.ctl.flags,
            [self._control_seg, self._io])
        self._weights = list(weights)
        self._index = SegmentIndex(self._weights)
        self.stats = PoolStats()
        self._lock = threading.RLock()  # wait() inside delta() reads failures under it
        self._next_job = 1
        # Failed jobs whose FAILED slot was reused (the latest `depth` of them).
        self._failures: OrderedDict[int, str] = OrderedDict()
        self._broken: WorkerFailure | None = None
        self._through: int | None = None  # finished_through() as abandon() found it
        self.pinned = pin
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            if pin:
                self._control_seg.pin()
                self._io.pin()
            for i, core in enumerate(self.cores):
                args = WorkerArgs(
                    index=i, core=core, workers=n, depth=cfg.depth,
                    control=(self._control_seg.fd, self._control_seg.size),
                    io=(self._io.fd, self._io.size),
                    weights=tuple((w.fd, w.size) for w in self._weights),
                    go_fd=self._go[i].fd, done_fd=self._done.fd,
                    spin_s=cfg.spin_s, ready_timeout_s=cfg.timeout_s)
                fds = (self._control_seg.fd, self._io.fd, *(w.fd for w in self._weights),
                       self._go[i].fd, self._done.fd)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "vllm_loraserve.worker.cpu_lora.proc",
                     args.to_json()], pass_fds=fds, env=env, stdin=subprocess.DEVNULL))
            self._await_start()
        except BaseException:
            self.close()
            raise
        self.speeds = [float(s) for s in self.ctl.speeds]
        shared = shares_vllm_cores(self.cores, cfg.gpu_workers, cfg.read_threads)
        logger.info("loraserve: %d CPU LoRA workers on cores %s%s, profile %s rows/s each",
                    n, self.cores, " (sharing cores with vLLM: CPU assistance will not pay "
                    "here)" if shared else "", [round(s) for s in self.speeds])
        if pin:
            assist_ops.log_availability()

    def _await_start(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not (self.ctl.speeds > 0).all():
            for i, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    raise WorkerFailure(f"CPU LoRA worker {i} (core {self.cores[i]}) exited "
                                        f"with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"CPU LoRA workers did not start within "
                                    f"{self.config.start_timeout_s} s")
            time.sleep(POLL_S)

    # -- the io segment ----------------------------------------------------
    def x_view(self, n: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a job's rows go: [n, in_features] of `dtype`, contiguous."""
        self._check_shape(n, in_features, 1)
        return strided(self._io.bytes, 0, (n, in_features), (in_features, 1), dtype)

    def y_view(self, n: int, out_features: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a job's results land (valid until the next job)."""
        self._check_shape(n, 1, out_features)
        return strided(self._io.bytes, self._y_off, (n, out_features), (out_features, 1), dtype)

    def _check_shape(self, n: int, k: int, m: int) -> None:
        cfg = self.config
        if n > cfg.max_rows or k > cfg.max_in or m > cfg.max_out:
            raise ValueError(f"a job of {n} x {k} -> {m} exceeds the pool's max_rows "
                             f"{cfg.max_rows}, max_in {cfg.max_in}, max_out {cfg.max_out}")

    # -- jobs --------------------------------------------------------------
    @property
    def flags(self) -> torch.Tensor:
        """The control flags as an int64 tensor (what the CUDA op reads and writes)."""
        return self.ctl.flags_tensor

    def _locate(self, t: torch.Tensor) -> _Loc | None:
        if t.dim() != 2 or t.dtype not in DTYPE_CODE or t.device.type != "cpu":
            raise ValueError(f"weights must be 2-D CPU tensors of {list(DTYPE_CODE)}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if min(t.stride()) < 0:
            return None
        span = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) \
            * t.element_size()
        found = self._index.find(t.data_ptr(), span)
        if found is None:
            return None
        i, offset = found  # the workers' segment 0 is the io segment
        return _Loc(i + 1, offset, *t.stride(), DTYPE_CODE[t.dtype])

    def _stage(self, ts: tuple[torch.Tensor, torch.Tensor]) -> list[_Loc]:
        locs, off = [], self._stage_off
        for t in ts:
            if t.shape[0] > self.config.max_rank:
                raise ValueError(f"rank {t.shape[0]} above max_rank {self.config.max_rank} "
                                 f"cannot be staged (pass weights that lie in `weights`)")
            strided(self._io.bytes, off, tuple(t.shape), (t.shape[1], 1), t.dtype).copy_(t)
            locs.append(_Loc(0, off, t.shape[1], 1, DTYPE_CODE[t.dtype]))
            off += t.numel() * t.element_size()
            off += -off % 64
            self.stats.staged_bytes += t.numel() * t.element_size()
        return locs

    def in_place(self, a: torch.Tensor, bt: torch.Tensor) -> list[_Loc]:
        """Where the workers read a and bt; ValueError unless both lie in `weights`."""
        locs = [self._locate(a), self._locate(bt)]
        if None in locs:
            raise ValueError("weights outside the pool's weight segments cannot be read "
                             "in place by the workers")
        return locs

    def post(self, n: int, x_dtype: torch.dtype, a: torch.Tensor, bt: torch.Tensor,
             scaling: float, y_dtype: torch.dtype, *, host_ready: bool, notify: bool,
             stage: bool, x_off: int = 0, y_off: int | None = None,
             ready_job: int | None = None, ring: bool = True,
             locs: list[_Loc] | None = None) -> int:
        """Post one job over n rows at byte `x_off` of the io segment, its
        results at byte `y_off` (default: the results area's start);
        returns its id. `host_ready`: the rows are in place (else whoever
        writes them sets flags[ctl.ready_index(r)] = r for r = `ready_job`,
        default this job: the GPU's copy_to_host_and_flag). `notify`:
        workers post the done semaphore (host waits). `stage`: copy weights
        outside `weights` into the io segment (one job in flight). `ring`:
        ring the workers now (else the caller rings once per batch). `locs`:
        where a and bt lie, from `in_place` (else looked up here)."""
        rank, k = a.shape
        m = bt.shape[1]
        if bt.shape[0] != rank or x_dtype not in DTYPE_CODE or y_dtype not in DTYPE_CODE:
            raise ValueError(f"a {tuple(a.shape)} and bt {tuple(bt.shape)} must share the rank; "
                             f"x and y dtypes must be among {list(DTYPE_CODE)}")
        self._check_shape(n, k, m)
        if locs is None:
            try:
                locs = self.in_place(a, bt)
            except ValueError:
                if not stage:
                    raise
                locs = self._stage((a, bt))
        job = self._next_job
        if job > self.layout.depth:  # the slot's previous job must be done
            self._await(job - self.layout.depth)
            self._keep_failure(job - self.layout.depth)
        d = self.ctl.jobs[job % self.layout.depth]
        d["job"], d["n"], d["in_features"], d["out_features"], d["rank"] = job, n, k, m, rank
        d["ready_job"] = job if ready_job is None else ready_job
        d["x_dtype"], d["y_dtype"] = DTYPE_CODE[x_dtype], DTYPE_CODE[y_dtype]
        d["x_off"], d["y_off"] = x_off, self._y_off if y_off is None else y_off
        d["notify"], d["scaling"] = int(notify), float(scaling)
        for name, loc in zip(("a", "bt"), locs, strict=True):
            d[f"{name}_seg"], d[f"{name}_off"] = loc.seg, loc.off
            d[f"{name}_s0"], d[f"{name}_s1"], d[f"{name}_dtype"] = loc.s0, loc.s1, loc.dtype
        d["rows"] = split_rows(n, self.speeds, self.config.min_rows)
        self._next_job = job + 1
        if host_ready:
            self.ctl.flags[self.ctl.ready_index(job)] = job
        if ring:
            for bell in self._go:
                bell.ring()
        self.stats.jobs += 1
        self.stats.rows += n
        return job

    def wait(self, job: int) -> None:
        """Block until every worker is done with `job` (a host wait); raise
        WorkerFailure if the pool broke, AssistError if `job` failed."""
        self._await(job)
        self.check()
        failure = self.failure([job])
        if failure is not None:
            raise AssistError(failure)

    def _await(self, job: int) -> None:
        self._raise_if_broken()
        done = self.ctl.done()
        deadline = time.monotonic() + self.config.timeout_s
        while done.min() < job:
            if self._done.wait(POLL_S) or done.min() >= job:
                continue
            self._check_alive(f" before finishing job {job}")
            if time.monotonic() > deadline:
                late = [i for i in range(len(done)) if done[i] < job]
                self._break(f"CPU LoRA workers {late} did not finish job {job} within "
                            f"{self.config.timeout_s} s")
        while self._done.take():  # rings of workers seen done above
            pass

    def _check_alive(self, when: str) -> None:
        for i, p in enumerate(self._procs):
            if p.poll() is not None:
                self._break(f"CPU LoRA worker {i} (core {self.cores[i]}, pid {p.pid}) died "
                            f"with exit code {p.returncode}{when}")

    def check(self) -> None:
        """Raise WorkerFailure if the pool broke: a device wait that timed
        out (its delta is not valid), or a dead worker. After `enqueue`,
        call it once the host has synchronised with the stream anyway (a
        step's end), then `failure` for each job's own error."""
        self._raise_if_broken()
        timed_out = int(self.ctl.flags[TIMED_OUT])
        if timed_out:
            self._break(f"the {'GPU' if self.pinned else 'host'} stopped waiting for CPU LoRA "
                        f"job {timed_out} after {self.config.timeout_s} s: the delta it added "
                        "is not valid")
        self._check_alive("")

    def finished_through(self) -> int:
        """The last job whose result is valid for certain: every worker
        finished it and every job before it, and no device wait up to it
        gave up or was released. A step's deltas whose jobs are all at most
        this are valid even if the pool broke after them (`check` speaks of
        the pool as it is now). Frozen by `abandon` (it releases the flags);
        0 once closed without it."""
        if self._through is not None:
            return self._through
        if not self._finalizer.alive:
            return 0
        through = int(self.ctl.done().min())
        timed_out = int(self.ctl.flags[TIMED_OUT])  # the first wait that gave up: its batch's last
        return min(through, timed_out - 1) if timed_out else through

    def failure(self, jobs: Sequence[int]) -> str | None:
        """A failure among `jobs`, each done (waited for, or passed by the
        stream), as text (one whose worker's message is still there, if
        any); None if none failed. Once closed the flags are gone: what
        `abandon` kept answers for the jobs it found finished, and any other
        job counts as failed."""
        closed = not self._finalizer.alive
        texts = []
        with self._lock:  # post() keeps failures
            for job in jobs:
                if closed:
                    text = self._failures.get(job)
                    if text is None and (self._through is None or job > self._through):
                        text = f"the CPU LoRA pool closed before job {job} was known done"
                else:
                    text = self._failures.pop(job, None)
                    if text is None and self.ctl.flags[self.ctl.failed_index(job)] == job:
                        text = self._failure_text(job)
                if text is not None:
                    texts.append(text)
        told = [t for t in texts if not t.endswith(LOST_MESSAGE)]
        return (told or texts or [None])[0]

    def _keep_failure(self, job: int) -> None:
        """Before `job`'s FAILED slot is reused: keep its failure for `failure`."""
        if self.ctl.flags[self.ctl.failed_index(job)] == job:
            self._failures[job] = self._failure_text(job)
            if len(self._failures) > self.layout.depth:
                self._failures.popitem(last=False)

    def _failure_text(self, job: int) -> str:
        errors = self.ctl.errors()
        for i in range(len(errors)):
            if errors[i] == job:
                return f"CPU LoRA worker {i} failed job {job}: {self.ctl.message(i)}"
        return f"a CPU LoRA worker failed job {job}{LOST_MESSAGE}"

    def _break(self, why: str) -> None:
        self._broken = WorkerFailure(why)
        raise self._broken

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise WorkerFailure(f"the CPU LoRA pool is unusable: {self._broken}")
        if not self._finalizer.alive:
            raise WorkerFailure("the CPU LoRA pool is closed")

    # -- the two ways in ---------------------------------------------------
    def delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: float,
              out_dtype: torch.dtype = torch.float32,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """((x @ a.T) * scaling) @ bt for x [n, in] (CPU), a [r, in], bt
        [r, out], in fp32, as an [n, out] tensor of `out_dtype`: `out` if
        given (a buffer the caller reuses, e.g. pinned for the copy up), else
        a new one. x may be `x_view(n, in, x.dtype)` itself (no copy in)."""
        if x.dim() != 2 or x.shape[1] != a.shape[1] or x.device.type != "cpu":
            raise ValueError(f"x {tuple(x.shape)} on {x.device} does not match a "
                             f"{tuple(a.shape)} on the CPU")
        n, m = x.shape[0], bt.shape[1]
        if out is None:
            out = torch.empty(n, m, dtype=out_dtype)
        elif out.shape != (n, m) or out.dtype != out_dtype or out.device.type != "cpu":
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not [{n}, {m}] "
                             f"{out_dtype} on the CPU")
        with self._lock:
            if self._next_job > 1:
                self._await(self._next_job - 1)  # jobs enqueued before finish first
            for start in range(0, n, self.config.max_rows):
                rows = x[start:start + self.config.max_rows]
                xin = self.x_view(rows.shape[0], rows.shape[1], rows.dtype)
                if rows.data_ptr() != xin.data_ptr() or not rows.is_contiguous():
                    xin.copy_(rows)
                job = self.post(rows.shape[0], rows.dtype, a, bt, scaling, out_dtype,
                                host_ready=True, notify=True, stage=True)
                self.wait(job)
                out[start:start + rows.shape[0]] = self.y_view(rows.shape[0], m, out_dtype)
        return out

    def enqueue(self, x: torch.Tensor, blocks: Sequence[Block],
                out: torch.Tensor) -> list[list[int]]:
        """out[b.start:b.end, b.col:b.col + m] = each block's delta of x's
        rows, in fp32 (out's other elements are left as they are), for x
        [n, in] and out [n, *] float32 on x's device: enqueued on the
        current CUDA stream with the csrc/ op (the host does not wait), or on
        the CPU with HostOps (the host waits). Rows beyond `max_rows` go in
        several batches. Returns each block's jobs: `check()`, then
        `failure(jobs)`, once the stream passed them. Raises ValueError, before enqueueing
        anything, for weights outside `weights` or shapes beyond the config."""
        ops = assist_ops.HostOps if x.device.type == "cpu" else assist_ops.ops()
        if x.is_cuda and not self.pinned:
            raise ValueError("enqueue on a GPU needs a pool made with pin=True")
        n, k = x.shape if x.dim() == 2 else (-1, -1)
        if not (x.dim() == out.dim() == 2 and out.shape[0] == n and x.is_contiguous()
                and out.dtype == torch.float32 and out.device == x.device):
            raise ValueError(f"x {tuple(x.shape)} (contiguous) and out {tuple(out.shape)} "
                             f"float32 on {x.device} do not match")
        batches, locs = self._plan(n, k, blocks, out.shape[1])
        timeout_ns = int(self.config.timeout_s * 1e9)
        jobs: list[list[int]] = [[] for _ in blocks]
        last = 0
        with self._lock:
            self._raise_if_broken()
            if self.ctl.flags[TIMED_OUT]:  # a wait gave up: no more waits that will time out
                self.check()
            for c0, c1, placed, y_end in batches:
                ready = self._next_job
                ops.copy_to_host_and_flag(x[c0:c1], self.x_view(c1 - c0, k, x.dtype),
                                          self.flags, self.ctl.ready_index(ready), ready)
                for i, s, e, y_off in placed:
                    b = blocks[i]
                    last = self.post(
                        e - s, x.dtype, b.a, b.bt, b.scaling, torch.float32, host_ready=False,
                        notify=False, stage=False, x_off=(s - c0) * k * x.element_size(),
                        y_off=y_off, ready_job=ready, ring=False, locs=locs[i])
                    jobs[i].append(last)
                for bell in self._go:
                    bell.ring(len(placed))
                ops.wait_host_flag(self.flags, self.layout.done0, last, len(self.cores),
                                   timeout_ns, TIMED_OUT)
                # One copy back of the batch's results (contiguous, in the io segment).
                ys = self._io.bytes[self._y_off:y_end].view(torch.float32).to(
                    x.device, non_blocking=True)
                for i, s, e, y_off in placed:
                    b = blocks[i]
                    o, m = (y_off - self._y_off) // 4, b.bt.shape[1]
                    out[s:e, b.col:b.col + m].copy_(ys[o:o + (e - s) * m].view(e - s, m))
        return jobs

    def _plan(self, n: int, k: int, blocks: Sequence[Block], width: int
              ) -> tuple[list[tuple[int, int, list[tuple[int, int, int, int]], int]],
                         list[list[_Loc]]]:
        """Batches of rows whose results fit the io segment (at most max_rows,
        fewer where out is wider than max_out): (first row, end, [(block
        index, its rows' start, end, results' byte offset)], results' end),
        checked before any is posted; and where each block's weights lie."""
        cfg = self.config
        rows = max(1, min(cfg.max_rows, cfg.max_rows * cfg.max_out // max(width, 1)))
        self._check_shape(min(n, rows), k, 1)
        for b in blocks:
            m = b.bt.shape[1]
            if not (0 <= b.start < b.end <= n and 0 <= b.col and b.col + m <= width
                    and b.a.shape[1] == k and b.bt.shape[0] == b.a.shape[0]
                    and b.a.dtype in DTYPE_CODE and b.bt.dtype in DTYPE_CODE):
                raise ValueError(f"block rows [{b.start}, {b.end}) cols [{b.col}, {b.col + m}) "
                                 f"with a {tuple(b.a.shape)} {b.a.dtype}, bt "
                                 f"{tuple(b.bt.shape)} {b.bt.dtype} do not fit x [{n}, {k}] "
                                 f"-> out [{n}, {width}]")
            self._check_shape(1, k, m)
        locs = [self.in_place(b.a, b.bt) for b in blocks]
        batches = []
        for c0 in range(0, n, rows):
            c1, y_off, placed = min(n, c0 + rows), self._y_off, []
            for i, b in enumerate(blocks):
                s, e = max(b.start, c0), min(b.end, c1)
                if s < e:
                    placed.append((i, s, e, y_off))
                    y_off += (e - s) * b.bt.shape[1] * 4
            if y_off > self._stage_off:
                raise ValueError(f"rows {c0}-{c1}: the blocks' results need "
                                 f"{y_off - self._y_off} bytes, the io segment holds "
                                 f"{self._stage_off - self._y_off} (max_rows x max_out fp32)")
            if placed:
                batches.append((c0, c1, placed, y_off))
        jobs = sum(len(p) for _, _, p, _ in batches)
        if jobs > self.layout.depth:
            raise ValueError(f"{jobs} jobs in one call exceed the ring's depth "
                             f"{self.layout.depth}")
        return batches, locs

    def warm_up(self, device: torch.device) -> None:
        """On CUDA: launch the op's kernels and the copies once, on flags
        already set (CUDA loads a kernel at its first launch, and that load
        waits for the whole device: a step's first batch must not be one)."""
        if device.type != "cuda":
            return
        ops = assist_ops.ops()
        ops.copy_to_host_and_flag(torch.zeros(1, 1, device=device),
                                  self.x_view(1, 1, torch.float32), self.flags,
                                  self.ctl.ready_index(0), 0)
        ops.wait_host_flag(self.flags, self.layout.done0, 0, len(self.cores), 0, TIMED_OUT)
        self.y_view(1, 1, torch.float32).to(device, non_blocking=True)
        torch.cuda.synchronize(device)

    # -- lifetime ----------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def abandon(self) -> None:
        """After a WorkerFailure, on the engine's thread: kill the workers and
        release every device wait already queued (their deltas are not
        valid; `check` keeps raising). The segments stay mapped, and
        registered with CUDA, until `close()`: call it once the stream has
        passed those waits, which read and copy them."""
        if self._through is None:
            self._through = self.finished_through()
            with self._lock:  # the finished jobs' failures outlive the flags (`failure`)
                for job in range(max(1, self._through - self.layout.depth + 1),
                                 self._through + 1):
                    self._keep_failure(job)
        flags = self.ctl.flags
        flags[TIMED_OUT] = flags[TIMED_OUT] or self._next_job  # queued waits return at once
        alive = []
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:  # stuck in the kernel: it cannot run on
                    alive.append(p.pid)
        if alive:
            logger.error("loraserve: CPU LoRA workers %s did not exit when killed", alive)
        self.ctl.done()[:] = RELEASED  # no worker is left to write them
        if self._broken is None:
            self._broken = WorkerFailure("abandoned after a failure")

    def close(self) -> None:
        """Stop the workers and unmap the segments (idempotent)."""
        self._finalizer()

    def __enter__(self) -> CpuWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
