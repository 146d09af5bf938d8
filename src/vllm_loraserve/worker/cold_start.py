"""Cold starts that do not wait for the whole adapter (--loraserve-cold-start).

In `block` mode (no `ColdStart`) a request whose adapter is not in the pool
waits, in its first step, for every layer's pages: one copy of the file's
bytes, packing and page writes for all layers, on the main stream before
the forward pass (worker/paged_manager.py). The other two modes take the
same step's loads that are not ahead (`PageLoad.ahead`: those still load
whole on the side stream, done before the next step) and write them layer
group by layer group (`cold_start_group_layers` layers each):

- `pipelined`: group k's bytes are copied, packed and written on the side
  stream (worker/load_lane.py), then its flag is signalled
  (worker/group_flags.py). Every LoRA module of a group's first layer waits
  on the device for that group's flag before its shrink, so the layers
  before group k run while group k is written, and no layer waits for a
  group other than its own. Those waits are launched in every step that
  writes groups, and captured in vLLM's CUDA graphs (a replay reads the
  current epoch and returns at once when no group is pending).
- `cpu-assist` (Toppings): the same group writes, and the loading adapters'
  slot table rows are hidden from the kernels (`DevicePool.hide`) while the
  forward pass runs on CPU deltas: at a group's first layer, if the group has
  not landed yet (`landed`: an event query, no wait), its layers add the
  cold adapters' deltas computed on the CPU from the host tier's copy. Two
  ways, chosen at start-up:
  - sync-free (the CPU worker processes of worker/cpu_lora/pool.py, with the
    csrc/ op on a GPU, or on the CPU): each module's deltas of every cold
    adapter are one `CpuWorkerPool.enqueue` batch on the stream, and the
    host never waits for the device. A job's failure is known only once
    the host has synchronised with the stream: `collect`, called with the
    step's report (after its output reached the host), puts the adapters
    whose jobs failed in that report, so their requests' outputs of that
    step are dropped, and the next `begin_step` clears their slots. A pool
    that broke is abandoned (its queued device waits released, see
    `CpuWorkerPool.abandon`) and closed once the stream has passed them;
  - synchronous (worker/assist.py on this process's threads, or the
    workers' `delta` where the op is missing on a GPU, logged at start-up):
    x is copied to the host, which waits for the device.
  A delta that fails fails its adapter alone; dead or stuck workers fail the
  adapters whose deltas were in flight (sync-free: a job past
  `CpuWorkerPool.finished_through`; an adapter whose jobs all finished before
  stays, even in a step reported after the failure) and make later deltas
  run on this process's threads (logged, and reported).
  From the first group that has landed on, the rows are shown again and the
  layers run the GPU kernels, waiting on each group's flag as `pipelined`
  does. A delta is thus computed on the CPU or by the kernels, never both.
  Such a step runs eagerly (`force_eager`: worker/hooks.py has vLLM pick no
  CUDA graph for it); later steps, decode included, run on the GPU.

A step whose host waits for the device before its first layer finds its
groups landed and runs them on the GPU, as `pipelined` does: correct, but
without the CPU's head start. On an H200 the modes' e2e test's first load
step waited so inside vLLM's (eager) forward pass, before layer 0, for the
whole side-stream hold (docs/benchmarks/cold-start.md, session 13). The
likely cause, not yet confirmed, is CUDA's lazy loading: a kernel's first
launch in the process (e.g. a GEMM at a token count no step has had) waits
for the whole device.

Ordering and deadlock freedom: the side stream waits for the main stream
once per step, before the first group (`StreamLane.start`: the pages' last
readers, as KV or as another adapter, and the table rows), and never again
while the forward pass may be spinning; the spin is one program, so the
side stream's kernels find SMs; the next step's main stream waits for the
whole side stream first (`begin_step`). CUDA_DEVICE_MAX_CONNECTIONS=1 would
put both streams in one hardware queue, where a spinning wait blocks the
writes it waits for: these modes refuse it.

On the CPU (no streams) the same code runs on a `HostLane`: `pipelined`
runs group k's work when a layer of group k is about to wait, and
`cpu-assist` assists every group of the load step (nothing lands before the
forward pass is over; `end_forward` writes the pages then, so a load that
fails there is in the step's report).

The host tier's bytes of a cold adapter are read during the forward pass
(CPU deltas, and the host lane's copies), so in these modes the tier's epoch
of a step closes after the forward pass (paged_manager.end_forward), not
before it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.paging.step import PageLoad
from vllm_loraserve.worker import assist_ops
from vllm_loraserve.worker.assist import CpuAssist, Delta
from vllm_loraserve.worker.cpu_lora.pool import Block, CpuWorkerPool, WorkerFailure
from vllm_loraserve.worker.group_flags import GroupFlags
from vllm_loraserve.worker.host_tier import HostAdapter
from vllm_loraserve.worker.load_lane import HostLane, StreamLane
from vllm_loraserve.worker.pool import DevicePool, capturing

logger = logging.getLogger(f"vllm.{__name__}")

MODES = ("block", "pipelined", "cpu-assist")
WARM_ROWS = 16  # rows of the cpu-assist warm-up
# Packs a group's layers from the file's bytes (on the device): [layers, n] streams.
Pack = Callable[[HostAdapter, range, torch.Tensor], torch.Tensor]


class Fail(Protocol):
    """Fails one load's adapter (`error`: the exception raised, if any)."""

    def __call__(self, load: PageLoad, reason: str, error: BaseException | None = None
                 ) -> None: ...


def layer_groups(num_layers: int, size: int) -> tuple[range, ...]:
    """Consecutive layer ranges of `size` layers (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"a layer group holds at least one layer, not {size}")
    return tuple(range(s, min(s + size, num_layers)) for s in range(0, num_layers, size))


def group_spans(entry: HostAdapter, groups: tuple[range, ...]) -> list[list[tuple[int, int]]]:
    """Per layer group, the byte ranges of the weights file's data that hold
    its layers' tensors, adjacent ones merged (the group's copies to the
    device). One pass over the tensors for all groups: a load asks once,
    not once a group (a 32-layer q/k/v/o adapter has 256 tensors)."""
    group_of = {layer: g for g, layers in enumerate(groups) for layer in layers}
    per_group: list[list[tuple[int, int]]] = [[] for _ in groups]
    for name, ab in entry.weights.modules.items():
        g = group_of.get(entry.where[name][0])
        if g is not None:
            per_group[g].extend((t.offset, t.offset + math.prod(t.shape) * t.dtype.itemsize)
                                for t in ab)
    out = []
    for spans in per_group:
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        out.append(merged)
    return out


def enqueues(assist: Delta | None, device: torch.device) -> bool:
    """Whether cpu-assist takes the sync-free path (see the module's doc)."""
    if not isinstance(assist, CpuWorkerPool):
        return False
    if device.type == "cpu":
        return True
    ok, why = assist_ops.available()
    if not (ok and assist.pinned):
        logger.warning("vllm-loraserve cpu-assist: the sync-free path is off (%s): each CPU "
                       "delta's copy of x waits for the device",
                       why if not ok else "the workers' segments are not pinned")
    return ok and assist.pinned


def _one_hardware_queue() -> bool:
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


def refuse_one_hardware_queue(mode: str) -> None:
    if mode != "block" and _one_hardware_queue():
        raise ValueError(f"--loraserve-cold-start {mode} needs the side stream in its own "
                         "hardware queue: unset CUDA_DEVICE_MAX_CONNECTIONS=1 (or use block)")


def resolve_mode(choice: str, device: torch.device) -> str:
    """--loraserve-cold-start with 'auto' resolved: `pipelined` on CUDA,
    which won online at 2000 adapters and cost nothing offline on an H200
    (docs/benchmarks/cold-start.md, sessions 18 and 26); `block` on the CPU,
    where a pipelined load's groups run on the host in the same order
    (HostLane) and gain nothing, and where one hardware queue would let a
    layer's wait block the writes it waits for (logged: the user asked for
    no mode)."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "block"
    if _one_hardware_queue():
        logger.warning("vllm-loraserve cold start: auto is block here, not pipelined: "
                       "CUDA_DEVICE_MAX_CONNECTIONS=1 puts the side stream in the main "
                       "stream's hardware queue")
        return "block"
    return "pipelined"


@dataclass
class _Cold:
    """One adapter loaded by groups in this step."""

    load: PageLoad
    entry: HostAdapter
    data: torch.Tensor | None = None  # the file's bytes on the device, filled by groups
    spans: list[list[tuple[int, int]]] | None = None  # group_spans, found at its first group
    failed: bool = False
    host_s: float = 0.0  # host seconds spent on its groups so far
    # cpu-assist: per layer, slice name -> (A [r, in], B [out, r]) in the host tier.
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    rows: torch.Tensor | None = None  # cpu-assist: its tokens' rows this step (device)
    jobs: list[int] = field(default_factory=list)  # its sync-free jobs this step


def _assist_failure(why: Exception | str) -> str:
    """What a failed CPU-assisted delta's adapter is told."""
    if isinstance(why, Exception):
        why = f"{type(why).__name__}: {why}"
    return f"its CPU-assisted delta failed: {why}"


class ColdStart:
    """The pool's `LayerGate` for `pipelined` and `cpu-assist` loads.
    `fail(load, reason, error=None)` fails one load (its requests, its
    slot; `error`, the exception raised, tells a transient failure);
    `done(load, seconds)` is told when a load's last group was written."""

    def __init__(self, mode: str, pool: DevicePool, device: torch.device,
                 side: torch.cuda.Stream | None, pack: Pack,
                 fail: Fail,
                 done: Callable[[PageLoad, float], None], assist: Delta | None) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"no layer-group loads in cold-start mode {mode!r}")
        if mode == "cpu-assist" and assist is None:
            raise ValueError("cpu-assist needs a CPU delta")
        refuse_one_hardware_queue(mode)
        self.mode, self.pool, self.device = mode, pool, torch.device(device)
        self.groups = pool.layer_groups
        self.group_of = [g for g, r in enumerate(self.groups) for _ in r]
        self.first_layers = frozenset(r.start for r in self.groups)
        self.flags = GroupFlags(len(self.groups), self.device,
                                self.device.type == "cuda" or pool.backend.name == "triton")
        self.lane = StreamLane(side, self.flags) if side is not None else HostLane(self.flags)
        self._pack, self._fail, self._done, self.assist = pack, fail, done, assist
        self.enqueues = mode == "cpu-assist" and enqueues(assist, self.device)
        # Steps whose sync-free deltas are not checked yet: (event after their
        # forward pass, the pool, the adapters with jobs).
        self._unchecked: deque[tuple[torch.cuda.Event | None, CpuWorkerPool,
                                     list[_Cold]]] = deque()
        self._jobs_pool: CpuWorkerPool | None = None  # the pool of this step's jobs
        # What `collect` found, for the next begin_step: failed adapters, a broken pool.
        self._collecting = threading.Lock()  # one collect at a time (two threads report)
        self._collected_lock = threading.Lock()
        self._collected: list[tuple[_Cold, str]] = []
        self._broken: tuple[CpuWorkerPool, WorkerFailure] | None = None
        # Abandoned pools, closed once the stream passed this event (after their batches).
        self._retired: deque[tuple[torch.cuda.Event, CpuWorkerPool]] = deque()
        # This step: groups in flight; assisted adapters; each group's
        # choice (True: GPU kernels, False: CPU deltas); rows shown again.
        self._pending = False
        self._assisted: list[_Cold] = []
        self._on_gpu: dict[int, bool] = {}
        self._switched = False
        # Totals for the residency report.
        self.pipelined_groups = 0  # (adapter, layer group) pairs written by groups
        self.assisted_groups = 0  # (adapter, layer group) pairs computed on the CPU
        self.sync_free_jobs = 0  # CPU delta jobs enqueued without a host wait
        self.pack_s = self.write_s = 0.0

    def warm_up(self, modules: Iterable[ModuleSlices] = ()) -> None:
        """Before serving: the flags' kernels, and in cpu-assist mode
        the device half of `after_layer` for each module kind. CUDA loads a
        kernel at its first launch (lazy module loading), and that load waits
        for the whole device, the side stream's held-back group writes
        included: a step's first CPU delta must not be the first launch of
        these kernels (on an H200 it was, and every group had landed by the
        time the layer ran). On the CPU it costs nothing and runs the same path."""
        self.flags.warm_up()
        if self.mode != "cpu-assist":
            return
        dtype = self.pool.pages[0].dtype
        # Two adapters' rows, as after_layer concatenates them (distinct rows).
        rows = torch.cat(torch.arange(WARM_ROWS, device=self.device).chunk(2))
        if self.enqueues:
            self.assist.warm_up(self.device)
        for m in modules:
            x = torch.zeros(WARM_ROWS, m.in_features, dtype=dtype, device=self.device)
            y = torch.zeros(WARM_ROWS, sum(m.out_features), dtype=dtype, device=self.device)
            xs = x.index_select(0, rows) if self.enqueues else self._rows_to_host(x, rows)
            out = torch.zeros(xs.shape[0], y.shape[1], device=xs.device)
            if self.enqueues:  # enqueue's copy into a slice's columns (strided)
                n = m.out_features[0]
                out[:, :n].copy_(torch.zeros(xs.shape[0] * n, device=xs.device).view(-1, n))
            self._add_delta(y, rows, out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- per step (paged_manager) ------------------------------------------
    def begin_step(self) -> None:
        """The last step's group writes are in place (the main stream waits
        for them) and its assisted adapters are visible to the kernels."""
        self.lane.drain()
        self._apply_collected()
        for c in self._assisted:
            if not c.failed and self._holds(c) and not self._switched:
                self.pool.show(c.load.slot)
        self._pending, self._assisted, self._on_gpu, self._switched = False, [], {}, False
        while self._retired and self._retired[0][0].query():
            self._retired.popleft()[1].close()
        self.flags.check()

    def _holds(self, c: _Cold) -> bool:
        """Whether `c`'s slot still holds its adapter."""
        resident = self.pool.slots.get(c.load.slot)
        return resident is not None and resident.lora_id == c.load.lora_request.lora_int_id

    def end_forward(self) -> None:
        """The forward pass is queued: the host lane writes the rest now, and
        the step's sync-free deltas wait for `collect`."""
        self.lane.after_forward()
        colds = [c for c in self._assisted if c.jobs]
        if colds:
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            self._unchecked.append((event, self._jobs_pool, colds))

    def collect(self) -> list[tuple[PageLoad, str]]:
        """With a step's report (its output is on the host; vLLM may build
        it on its output thread): the loads whose sync-free deltas failed,
        in each step whose forward pass is over (an event query, no wait;
        the reported step's is over: its output's copy came after it), for
        the report. No slot or page changes here: the next `begin_step`, on
        the engine's thread, fails those adapters (and retires broken
        workers). vLLM reports an async step's output on its output thread
        and an empty step's on the engine's, so two may come at once."""
        with self._collecting:
            return self._collect()

    def _collect(self) -> list[tuple[PageLoad, str]]:
        out = []
        while self._unchecked:
            event, pool, colds = self._unchecked[0]
            if event is not None and not event.query():
                break
            self._unchecked.popleft()
            failed = []
            try:
                pool.check()
            except WorkerFailure as e:  # the deltas of jobs it finished before are valid
                through = pool.finished_through()
                failed = [(c, f"WorkerFailure: {e}") for c in colds if max(c.jobs) > through]
                colds = [c for c in colds if max(c.jobs) <= through]
                with self._collected_lock:
                    self._broken = self._broken or (pool, e)
            failed += [(c, f"AssistError: {text}") for c in colds
                       if (text := pool.failure(c.jobs)) is not None]
            for c, why in failed:
                out.append((c.load, _assist_failure(why)))
                with self._collected_lock:
                    self._collected.append((c, why))
        return out

    def _apply_collected(self) -> None:
        """On the engine's thread: what `collect` found."""
        with self._collected_lock:
            collected, self._collected = self._collected, []
            broken, self._broken = self._broken, None
        for c, why in collected:
            self._fail_assisted(c, why)
        if broken is not None and broken[0] is self.assist:
            self._workers_failed(broken[1])

    def _fail_assisted(self, c: _Cold, why: Exception | str) -> None:
        """Its rows' delta is incomplete: its requests fail (their outputs
        are dropped); the other adapters go on. From `collect`, a step
        later: its slot may hold another adapter by then, which stays."""
        if not c.failed:
            c.failed, c.data = True, None
            if self._holds(c):
                self._fail(c.load, _assist_failure(why))

    @property
    def force_eager(self) -> bool:
        """This step has CPU-assisted adapters: no CUDA graph may run it."""
        return any(not c.failed for c in self._assisted)

    def load(self, loads: list[tuple[PageLoad, HostAdapter]]) -> None:
        """Start this step's loads (none ahead) group by group: slots and
        table rows on the main stream now, pages on the lane."""
        self.flags.advance()
        if self.enqueues:  # a worker that died since: before any of this step's batches
            try:
                self.assist.check()
            except WorkerFailure as e:
                self._workers_failed(e)
        colds = []
        for load, entry in loads:
            try:
                self.pool.begin_load(load.slot, load.lora_request.lora_int_id, entry.placement,
                                     load.page_ids)
            except Exception as e:
                self._fail(load, f"its pages could not be written: {type(e).__name__}: {e}", e)
                continue
            cold = _Cold(load, entry)
            if self.mode == "cpu-assist":
                self.pool.hide(load.slot)
                cold.weights = entry.layer_weights(range(self.pool.num_layers))
            colds.append(cold)
        self.lane.start()
        for g in range(len(self.groups)):
            for cold in colds:
                self.lane.submit(g, lambda c=cold, g=g: self._write(c, g),
                                 lambda e, c=cold: self._failed(c, e))
            self.lane.close(g)
        self._pending = True
        if self.mode == "cpu-assist":
            self._assisted = colds

    def _write(self, cold: _Cold, g: int) -> None:
        """Group g of one adapter: its bytes to the device, packed, its pages."""
        if cold.failed:
            return
        t0 = time.perf_counter()
        host = cold.entry.weights.data
        layers = self.groups[g]
        if self.device.type == "cpu":
            cold.data = host
        else:
            if cold.data is None:  # allocated on the lane's stream, used only there
                cold.data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            if cold.spans is None:
                cold.spans = group_spans(cold.entry, self.groups)
            for start, end in cold.spans[g]:
                cold.data[start:end].copy_(host[start:end], non_blocking=True)
        streams = self._pack(cold.entry, layers, cold.data)
        t1 = time.perf_counter()
        self.pool.write_group(cold.load.slot, g, streams)
        t2 = time.perf_counter()
        self.pack_s += t1 - t0
        self.write_s += t2 - t1
        cold.host_s += t2 - t0
        self.pipelined_groups += 1
        if g == len(self.groups) - 1:
            cold.data = None
            self._done(cold.load, cold.host_s)

    def _failed(self, cold: _Cold, e: Exception) -> None:
        cold.failed, cold.data = True, None
        self._fail(cold.load, f"its pages could not be written: {type(e).__name__}: {e}", e)

    # -- per layer (the pool's LayerGate) ------------------------------------
    def set_tokens(self, token_slots: np.ndarray) -> None:
        for c in self._assisted:
            rows = np.flatnonzero(token_slots == c.load.slot)
            # Asynchronous: a blocking copy from pageable memory would wait for
            # the step in flight (torch synchronizes the stream); CUDA stages
            # an asynchronous one from pageable memory at once, device-ordered.
            c.rows = torch.as_tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def before_layer(self, layer: int, x: torch.Tensor) -> None:
        capture = self.mode == "pipelined" and capturing(x)
        if not (self._pending or capture):
            return
        g = self.group_of[layer]
        if self._assisted and g not in self._on_gpu:
            on_gpu = self._on_gpu[g] = self._switched or self.lane.landed(g)
            if on_gpu and not self._switched:
                self._switched = True
                for c in self._assisted:
                    if not c.failed:
                        self.pool.show(c.load.slot)
            if not on_gpu:
                self.assisted_groups += sum(not c.failed for c in self._assisted)
        if layer in self.first_layers and self._on_gpu.get(g, True):
            self.lane.run_until(g)
            self.flags.wait(g)

    def after_layer(self, layer: int, module: ModuleSlices, x: torch.Tensor,
                    y: torch.Tensor) -> None:
        if not self._assisted or self._on_gpu.get(self.group_of[layer], True):
            return
        live = [c for c in self._assisted
                if not c.failed and c.rows is not None and c.rows.numel()]
        if not live:
            return
        rows = torch.cat([c.rows for c in live]) if len(live) > 1 else live[0].rows
        if self.enqueues:
            try:
                self._enqueue(live, rows, layer, module, x, y)
                return
            except WorkerFailure as e:  # the pool broke before: this layer runs below
                self._workers_failed(e)
        xs = self._rows_to_host(x, rows)
        out = torch.zeros(rows.numel(), sum(module.out_features), dtype=torch.float32)
        lo = 0
        for c in live:
            n = c.rows.numel()
            try:
                try:
                    self._deltas(c, layer, module, xs[lo:lo + n], out[lo:lo + n])
                except WorkerFailure as e:
                    if not isinstance(self.assist, CpuWorkerPool):
                        raise
                    self._workers_failed(e)
                    self._deltas(c, layer, module, xs[lo:lo + n], out[lo:lo + n])
            except Exception as e:  # e.g. a weight dtype the workers refuse
                self._fail_assisted(c, e)
            lo += n
        self._add_delta(y, rows, out)

    def _enqueue(self, live: list[_Cold], rows: torch.Tensor, layer: int,
                 module: ModuleSlices, x: torch.Tensor, y: torch.Tensor) -> None:
        """The sync-free path: every live adapter's slices in one batch."""
        blocks: list[Block] = []
        owners: list[tuple[_Cold, range]] = []
        lo = 0
        for c in live:
            n = c.rows.numel()
            mine = [Block(lo, lo + n, col, a, b.T, c.entry.scaling)
                    for col, (a, b) in self._slices(c, layer, module)]
            try:
                for block in mine:
                    self.assist.in_place(block.a, block.bt)
            except ValueError as e:  # e.g. a weight dtype the workers refuse
                self._fail_assisted(c, e)
                mine = []
            owners.append((c, range(len(blocks), len(blocks) + len(mine))))
            blocks += mine
            lo += n
        if not blocks:
            return
        out = torch.zeros(rows.numel(), sum(module.out_features), dtype=torch.float32,
                          device=y.device)
        jobs = self.assist.enqueue(x.index_select(0, rows), blocks, out)
        self._jobs_pool = self.assist
        for c, span in owners:
            c.jobs += [j for i in span for j in jobs[i]]
        self.sync_free_jobs += sum(map(len, jobs))
        self._add_delta(y, rows, out)

    def _slices(self, cold: _Cold, layer: int, module: ModuleSlices):
        """(output column, (A, B)) of each of `module`'s slices `cold` targets."""
        weights = cold.weights[layer]
        for s, col in enumerate(module.out_offsets):
            ab = weights.get(self.pool.slices[module.first + s].name)
            if ab is not None:
                yield col, ab

    def _deltas(self, cold: _Cold, layer: int, module: ModuleSlices, xs: torch.Tensor,
                out: torch.Tensor) -> None:
        """out[:, slice s columns] = the delta of every slice `cold` targets
        (written, not added: a retry overwrites a partial attempt)."""
        for col, (a, b) in self._slices(cold, layer, module):
            self.assist.delta(xs, a, b.T, cold.entry.scaling, out=out[:, col:col + b.shape[0]])

    def _workers_failed(self, e: WorkerFailure) -> None:
        """The pool is unusable from now on: this and later deltas run on this
        process's threads, and the report's worker count says 0."""
        logger.error("vllm-loraserve cpu-assist: the CPU LoRA workers failed (%s); deltas run "
                     "on the engine's own threads from now on", e)
        pool = self.assist
        pool.abandon()  # releases the device waits queued on the stream
        if self.device.type == "cuda":  # their copies still read its segments
            event = torch.cuda.Event()
            event.record()
            self._retired.append((event, pool))
        else:
            pool.close()
        self.assist = CpuAssist()
        self.enqueues = False

    @property
    def assist_workers(self) -> int:
        """CPU worker processes computing the deltas (0: this process's threads)."""
        return len(self.assist.cores) if isinstance(self.assist, CpuWorkerPool) else 0

    @staticmethod
    def _rows_to_host(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Waits for the device to reach this layer (the synchronous path).
        return x.index_select(0, rows).cpu()

    @staticmethod
    def _add_delta(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """y[rows] += delta (fp32, on the CPU or y's device), with one
        rounding to y's dtype, as the expand kernel's."""
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta.to(y.device))
                      .to(y.dtype))
