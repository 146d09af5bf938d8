"""Cold starts by layer groups (worker/cold_start.py) on the CPU, layer by
layer, against the same adapters loaded whole (`block`).

The CPU engine's lane (worker/load_lane.HostLane) writes a group only when
a layer of it waits, or at the next step's start, so every test here also
sees what a layer would read if it skipped its wait: pages never written."""

from __future__ import annotations

import math
import os
import re
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_loraserve.adapters.peft import read_weights, short_name
from vllm_loraserve.demo.assets import make_adapter
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.paging.layout import pack_layers
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.paging.step import PageLoad
from vllm_loraserve.worker import cold_start as cold_mod
from vllm_loraserve.worker.assist import CpuAssist
from vllm_loraserve.worker.cold_start import ColdStart, group_spans, layer_groups
from vllm_loraserve.worker.cpu_lora.control import TIMED_OUT
from vllm_loraserve.worker.cpu_lora.pool import AssistError, CpuPoolConfig, CpuWorkerPool
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks
from vllm_loraserve.worker.group_flags import FlagTimeout
from vllm_loraserve.worker.host_tier import HostAdapter
from vllm_loraserve.worker.pool import DevicePool

LAYERS = 6
CFG = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=96, num_hidden_layers=LAYERS)
KV_SHAPE = (200, 2, 16, 32)  # 1024-element pages
LAYOUT = model_layout(CFG, 1024)
DIMS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
PATHS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
         "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MODULES = [ModuleSlices.of(LAYOUT, names) for names in
           (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
            ("down_proj",))]
GROUP = 2  # layers per group: 3 groups


def host_adapter(tmp_path, name, rank, targets, seed, pin=False, alloc=None) -> HostAdapter:
    """An adapter written as PEFT files and read as the host tier reads it
    (into pinned memory with `pin`, as the tier's arena is on a GPU; into
    `alloc(nbytes)`'s buffer if given)."""
    dims = {f"model.layers.{layer}.{PATHS[t]}.{t}": DIMS[t]
            for layer in range(LAYERS) for t in targets}
    path = str(tmp_path / name)
    make_adapter(path, dims, rank=rank, alpha=2 * rank, seed=seed, base_model="tiny",
                 strength=2.0)
    spec, raw = read_weights(path, alloc or (lambda n: torch.empty(n, dtype=torch.uint8,
                                                                    pin_memory=pin)))
    where = {m: (int(re.search(r"layers\.(\d+)\.", m).group(1)), short_name(m))
             for m in raw.modules}
    return HostAdapter(name, LAYOUT.place(spec.rank, spec.target_modules), spec.scaling, raw,
                       where)


def pack(entry: HostAdapter, layers: range, data: torch.Tensor) -> torch.Tensor:
    return pack_layers(LAYOUT, entry.placement, entry.layer_weights(layers, data),
                       entry.scaling, torch.float32)


def make_adapters(root, alloc=None):
    return {"warm": host_adapter(root, "warm", 16, ("q_proj", "v_proj", "down_proj"), 1,
                                 alloc=alloc),
            "cold": host_adapter(root, "cold", 8, tuple(DIMS), 2, alloc=alloc),
            "cold2": host_adapter(root, "cold2", 32, ("o_proj", "gate_proj", "up_proj"), 3,
                                  alloc=alloc)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return make_adapters(tmp_path_factory.mktemp("adapters"))


def shared_alloc(chunks: SharedChunks):
    """Buffers in shared chunks, as the host tier's arena gives them to cpu-assist."""
    return lambda n: chunks(-(-n // 4096) * 4096)[:n]


def worker_pool(chunks: SharedChunks, cls=CpuWorkerPool, timeout_s: float = 60.0):
    """One worker process reading the chunks (a module's results side by side:
    max_out 192, gate_up's)."""
    return cls(CpuPoolConfig(workers=1, max_rows=64, max_in=96, max_out=192, max_rank=32,
                             timeout_s=timeout_s), weights=chunks.segments)


@pytest.fixture(scope="module")
def on_workers(tmp_path_factory):
    """The adapters in shared chunks, and a worker pool over them: cpu-assist's
    sync-free path (CpuWorkerPool.enqueue on the CPU's HostOps)."""
    chunks = SharedChunks(pinned=False)
    adapters = make_adapters(tmp_path_factory.mktemp("shared"), shared_alloc(chunks))
    pool = worker_pool(chunks)
    yield adapters, pool
    pool.close()
    chunks.close()


@pytest.fixture(params=["threads", "workers"])
def assisted(request, adapters):
    """(adapters, assist): this process's threads (synchronous), or the
    worker processes (sync-free)."""
    if request.param == "threads":
        return adapters, CpuAssist()
    return request.getfixturevalue("on_workers")


def page_ids(entry, first):
    return tuple(range(first, first + entry.placement.num_pages))


class Step:
    """A block pool and a group-loading pool over equal KV, the warm adapter
    resident in both, `cold` adapters loading in this step."""

    def __init__(self, adapters, mode, backend="torch", cold=("cold",), assist=None):
        self.adapters, self.names = adapters, cold
        self.failed: dict[int, str] = {}
        self.errors: dict[int, BaseException | None] = {}  # what `fail` was given
        self.done: list[int] = []
        self.pools = []
        # The block pool on the reference kernels, the grouped one on `backend`.
        for groups, kernels in (((), "torch"), (layer_groups(LAYERS, GROUP), backend)):
            kv = [torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(9 + i))
                  for i in range(LAYERS)]
            p = DevicePool(LAYOUT.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                           max_slices=3, backend=kernels, device=torch.device("cpu"),
                           layer_groups=groups)
            p.bind(kv)
            warm = adapters["warm"]
            p.load(0, 1, warm.placement, page_ids(warm, 1),
                   pack(warm, range(LAYERS), warm.weights.data))
            self.pools.append(p)
        self.block, self.grouped = self.pools
        self.cold = ColdStart(mode, self.grouped, torch.device("cpu"), None, pack,
                              self._fail, lambda load, s: self.done.append(load.slot),
                              assist or CpuAssist())
        self.cold.warm_up(MODULES)  # as at bind: must leave no trace in the pools
        self.grouped.gate = self.cold
        self.loads = []
        for i, name in enumerate(cold):
            entry = adapters[name]
            load = PageLoad(2 + i, SimpleNamespace(lora_int_id=10 + i, lora_name=name),
                            entry.placement.rank, page_ids(entry, 30 + 70 * i))
            self.block.load(load.slot, 10 + i, entry.placement, load.page_ids,
                            pack(entry, range(LAYERS), entry.weights.data))
            self.loads.append((load, entry))
        self.cold.begin_step()
        self.cold.load(self.loads)

    def _fail(self, load, reason, error=None):
        self.failed[load.lora_request.lora_int_id] = reason
        self.errors[load.lora_request.lora_int_id] = error
        self.grouped.evict(load.slot)

    def tokens(self, ids):
        """The step's token -> adapter ids (those of adapters not loaded: none)."""
        ids = np.asarray([i if i in self.block.slot_of else 0 for i in ids])
        for p in self.pools:
            p.set_tokens(ids, ignored_ids=set())

    def layer(self, layer, x, y0):
        """Every module of one layer in both pools: [(block y, grouped y)]."""
        out = []
        for module in MODULES:
            xm = x[:, :module.in_features]
            y = y0[:, :sum(module.out_features)]
            yb, yg = y.clone(), y.clone()
            self.block.add_lora(layer, module, xm, yb)
            self.grouped.add_lora(layer, module, xm, yg)
            out.append((yb, yg))
        return out

    def cold_pages_written(self, layer):
        """Whether the grouped pool's pages of `layer` hold the cold adapters
        as the block pool's do."""
        return all(torch.equal(self.grouped.pages[layer][list(load.page_ids)],
                               self.block.pages[layer][list(load.page_ids)])
                   for load, _ in self.loads)


TOKENS = [10, 1, 0, 10, 10, 1, 11, 11, 0, 10]


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(TOKENS), 96, generator=g), torch.randn(len(TOKENS), 192, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipelined_layers_equal_block_and_each_waits_for_its_own_group(adapters, backend):
    step = Step(adapters, "pipelined", backend, cold=("cold", "cold2"))
    step.tokens(TOKENS)
    x, y0 = inputs()
    assert not any(step.cold_pages_written(layer) for layer in range(LAYERS))
    for layer in range(LAYERS):
        for yb, yg in step.layer(layer, x, y0):
            assert not torch.equal(yb, y0)
            torch.testing.assert_close(yg, yb, rtol=1e-4, atol=1e-4)
        # Group k is written once its first layer waited, and no later group.
        written = [step.cold_pages_written(lay) for lay in range(LAYERS)]
        assert written == [lay // GROUP <= layer // GROUP for lay in range(LAYERS)]
    # Every module of a group's first layer waited; no other layer did.
    assert step.cold.flags.waits == len(MODULES) * (LAYERS // GROUP)
    assert step.done == [2, 3] and not step.failed
    assert step.cold.pipelined_groups == 2 * (LAYERS // GROUP)
    step.cold.begin_step()  # the next step: nothing pending, nobody waits
    step.tokens(TOKENS)
    for yb, yg in step.layer(3, x, y0):
        torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
    assert step.cold.flags.waits == len(MODULES) * (LAYERS // GROUP)


def test_a_layer_that_skips_its_wait_reads_pages_never_written(adapters):
    """Both ways a wait can go missing fail: without the gate the layer reads
    unwritten pages (its output differs from block's); with a gate whose
    group was never signalled the wait itself raises."""
    step = Step(adapters, "pipelined")
    step.tokens(TOKENS)
    x, y0 = inputs()
    gate, step.grouped.gate = step.grouped.gate, None
    assert any(not torch.allclose(yg, yb, atol=1e-3) for yb, yg in step.layer(0, x, y0))
    step.grouped.gate = gate
    gate.lane.run_until = lambda group: None  # the group's work never runs
    with pytest.raises(FlagTimeout, match="layer group 1 is read before"):
        step.layer(2, x, y0)


def test_triton_wait_counts_a_timeout_that_check_reports(adapters):
    step = Step(adapters, "pipelined", backend="triton")
    step.cold.flags.max_spins = 3
    step.cold.lane.run_until = lambda group: None
    step.tokens(TOKENS)
    x, y0 = inputs()
    step.layer(0, x, y0)
    assert int(step.cold.flags.timeouts[0]) == len(MODULES)
    with pytest.raises(FlagTimeout, match="4 layer wait"):
        step.cold.flags.check()


def test_cpu_assist_equals_block_with_every_group_on_the_cpu(assisted):
    adapters, assist = assisted
    step = Step(adapters, "cpu-assist", cold=("cold", "cold2"), assist=assist)
    assert step.cold.enqueues == isinstance(assist, CpuWorkerPool)
    assert step.cold.force_eager
    step.tokens(TOKENS)
    x, y0 = inputs()
    for layer in range(LAYERS):
        for yb, yg in step.layer(layer, x, y0):
            torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
    # Nothing landed during the step: every group of both adapters on the CPU.
    assert not any(step.cold_pages_written(layer) for layer in range(LAYERS))
    assert step.cold.assisted_groups == 2 * (LAYERS // GROUP)
    assert step.cold.flags.waits == 0
    # Sync-free: one job per adapter and slice it targets, in every layer.
    slices = sum(len(w) for name in ("cold", "cold2")
                 for w in adapters[name].layer_weights(range(LAYERS)))
    assert step.cold.sync_free_jobs == (slices if step.cold.enqueues else 0)
    # Written once the forward pass is over; the next step (decode) shows
    # the rows and the kernels serve it.
    step.cold.end_forward()
    assert step.cold.collect() == [] and not step.failed
    assert all(step.cold_pages_written(layer) for layer in range(LAYERS))
    step.cold.begin_step()
    assert not step.cold.force_eager
    step.tokens(TOKENS[:4])
    x, y0 = inputs(1)
    for layer in range(LAYERS):
        for yb, yg in step.layer(layer, x[:4], y0[:4]):
            torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
    assert step.cold.assisted_groups == 2 * (LAYERS // GROUP)


def test_cpu_assist_switches_to_the_kernels_once_a_group_landed(assisted):
    """Group 0 on the CPU; groups 0 and 1 land before layer 2 runs: from
    there the kernels compute the cold adapter, waiting as pipelined does.
    A CPU delta added for a layer whose kernels ran too (counted twice), or
    a kernel reading a hidden slot, would break the equality."""
    adapters, assist = assisted
    step = Step(adapters, "cpu-assist", assist=assist)
    step.tokens(TOKENS)
    x, y0 = inputs()
    for layer in range(LAYERS):
        if layer == GROUP:
            step.cold.lane.run_until(1)
        for yb, yg in step.layer(layer, x, y0):
            torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
    assert step.cold.assisted_groups == 1
    assert step.cold.flags.waits == len(MODULES) * 2  # groups 1 and 2
    assert all(step.cold_pages_written(layer) for layer in range(LAYERS))


@pytest.mark.parametrize("hidden", [True, False])
def test_a_delta_counted_twice_breaks_the_equality(assisted, monkeypatch, hidden):
    """Pages written but every group still on the CPU: with the slot hidden,
    as cpu-assist hides it, the outputs equal block's; shown, the kernels
    would add the cold adapter's delta beside the CPU's."""
    if not hidden:
        monkeypatch.setattr(DevicePool, "hide", lambda self, slot: None)
    adapters, assist = assisted
    step = Step(adapters, "cpu-assist", assist=assist)
    step.cold.lane.drain()
    step.cold.lane.landed = lambda group: False
    step.tokens(TOKENS)
    x, y0 = inputs()
    outs = step.layer(0, x, y0)
    assert all(torch.allclose(yg, yb, atol=1e-4) for yb, yg in outs) == hidden


class FailingFor(CpuAssist):
    """CpuAssist, but a delta of one adapter's weights raises `error`."""

    def __init__(self, entry: HostAdapter, error: Exception) -> None:
        self.error = error
        self.bad = {a.data_ptr() for w in entry.layer_weights(range(LAYERS))
                    for a, _ in w.values()}

    def delta(self, x, a, bt, scaling, out_dtype=torch.float32, out=None):
        if a.data_ptr() in self.bad:
            raise self.error
        return super().delta(x, a, bt, scaling, out_dtype, out)


def assert_layers_equal_block(step, but: int):
    """Every layer of the step: the grouped pool's outputs equal block's,
    but in the rows of adapter id `but` (one that failed)."""
    x, y0 = inputs()
    rows = [i for i, t in enumerate(TOKENS) if t != but]
    for layer in range(LAYERS):
        for yb, yg in step.layer(layer, x, y0):
            torch.testing.assert_close(yg[rows], yb[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("error", [AssistError("injected"), ValueError("injected dtype")])
def test_a_failed_cpu_delta_fails_its_adapter_alone(adapters, error):
    """A worker's job error, or any other error of one adapter's delta (e.g.
    a weight dtype the workers refuse), fails that adapter alone."""
    step = Step(adapters, "cpu-assist", cold=("cold", "cold2"),
                assist=FailingFor(adapters["cold2"], error))
    step.tokens(TOKENS)
    assert_layers_equal_block(step, but=11)
    assert list(step.failed) == [11] and "CPU-assisted delta failed" in step.failed[11] \
        and "injected" in step.failed[11]
    # Both adapters' group 0 on the CPU (cold2 failed in layer 0), then cold's alone.
    assert step.cold.assisted_groups == 2 + (LAYERS // GROUP - 1)
    step.cold.end_forward()
    assert 11 not in step.grouped.slot_of and step.done == [2]


class FailsFor(CpuWorkerPool):
    """A worker pool whose workers fail every job of one adapter's weights
    (its descriptor points outside every segment, as a corrupt one would)."""

    bad: set[int] = set()

    def post(self, n, x_dtype, a, bt, *args, **kw):
        job = super().post(n, x_dtype, a, bt, *args, **kw)
        if a.data_ptr() in self.bad:
            self.ctl.jobs[job % self.layout.depth]["a_off"] = 1 << 40
        return job


def test_a_failed_sync_free_job_fails_its_adapter_alone_at_collect(tmp_path):
    """On the sync-free path a job's failure is known once the host has
    synchronised with the stream: nothing fails during the forward pass;
    `collect` (with the step's report) names cold2 alone, and the next
    `begin_step` fails it and clears its slot. cold's rows equal block's."""
    chunks = SharedChunks(pinned=False)
    adapters = make_adapters(tmp_path, shared_alloc(chunks))
    pool = worker_pool(chunks, FailsFor)
    pool.bad = {a.data_ptr() for w in adapters["cold2"].layer_weights(range(LAYERS))
                for a, _ in w.values()}
    try:
        step = Step(adapters, "cpu-assist", cold=("cold", "cold2"), assist=pool)
        assert step.cold.enqueues
        step.tokens(TOKENS)
        assert_layers_equal_block(step, but=11)
        assert not step.failed
        step.cold.end_forward()
        jobs = {c.load.lora_request.lora_int_id: c.jobs for c in step.cold._unchecked[0][2]}
        ((load, why),) = step.cold.collect()
        assert load.lora_request.lora_int_id == 11 and not step.failed
        assert re.search(r"CPU-assisted delta failed: AssistError: CPU LoRA worker 0 failed "
                         r"job \d+: ValueError", why), why
        assert step.cold.assisted_groups == 2 * (LAYERS // GROUP)
        step.cold.begin_step()
        assert step.failed == {11: why}
        assert 11 not in step.grouped.slot_of and 10 in step.grouped.slot_of
        assert step.cold.assist_workers == 1  # the workers go on
        pool.abandon()
        pool.close()  # what abandon kept still tells the failed job from the good ones
        assert pool.failure(jobs[11]) == why.split("AssistError: ", 1)[1]
        assert pool.failure(jobs[10]) is None
    finally:
        pool.close()
        chunks.close()


class PendingEvent:
    """A CUDA event whose step is still on the device: query() False, and
    a wait on it would stall the host (raises here)."""

    def query(self):
        return False

    def synchronize(self):
        raise AssertionError("collect waited for a step still in flight")


def test_collect_never_waits_for_a_step_in_flight(on_workers):
    """Under async scheduling the next step is queued before this one's
    report: collect takes only the steps whose event has passed, and a
    later collect takes the rest."""
    adapters, pool = on_workers
    step = Step(adapters, "cpu-assist", assist=pool)
    step.tokens(TOKENS)
    x, y0 = inputs()
    step.layer(0, x, y0)
    step.cold.end_forward()
    done = step.cold._unchecked.pop()
    step.cold._unchecked.append((PendingEvent(), *done[1:]))
    assert step.cold.collect() == [] and len(step.cold._unchecked) == 1
    step.cold._unchecked[0] = done  # the step's forward pass is over now
    assert step.cold.collect() == [] and not step.cold._unchecked


def test_a_worker_dead_between_steps_is_found_before_any_batch(tmp_path):
    """The load step checks the workers first: a dead one sends this step's
    deltas to the engine's threads at once (no batch waits for it, nothing
    fails)."""
    chunks = SharedChunks(pinned=False)
    adapters = make_adapters(tmp_path, shared_alloc(chunks))
    pool = worker_pool(chunks, timeout_s=60.0)
    try:
        os.kill(pool.pids[0], signal.SIGKILL)
        pool._procs[0].wait(10)
        step = Step(adapters, "cpu-assist", cold=("cold", "cold2"), assist=pool)
        assert step.cold.assist_workers == 0 and not step.cold.enqueues
        step.tokens(TOKENS)
        assert_layers_equal_block(step, but=-1)
        step.cold.end_forward()
        assert step.cold.collect() == [] and not step.failed and pool.stats.jobs == 0
    finally:
        pool.close()
        chunks.close()


def test_a_worker_dead_after_a_steps_jobs_leaves_that_step_valid(tmp_path):
    """Under async scheduling a worker may die after a step's jobs finished
    and before its report: `collect` must not fail that step's adapters
    (their deltas are complete), only hand the next steps to the engine's
    threads. Jobs from the first device wait that gave up on are not valid,
    finished or not."""
    chunks = SharedChunks(pinned=False)
    adapters = make_adapters(tmp_path, shared_alloc(chunks))
    pool = worker_pool(chunks, timeout_s=60.0)
    try:
        step = Step(adapters, "cpu-assist", cold=("cold", "cold2"), assist=pool)
        step.tokens(TOKENS)
        assert_layers_equal_block(step, but=-1)
        step.cold.end_forward()
        (_, _, colds), = step.cold._unchecked
        last = max(max(c.jobs) for c in colds)
        assert pool.finished_through() == last
        pool.ctl.flags[TIMED_OUT] = last  # had the wait for `last` given up: its batch is not valid
        assert pool.finished_through() == last - 1
        pool.ctl.flags[TIMED_OUT] = 0
        os.kill(pool.pids[0], signal.SIGKILL)
        pool._procs[0].wait(10)
        assert step.cold.collect() == []
        step.cold.begin_step()
        assert not step.failed and {10, 11} <= step.grouped.slot_of.keys()
        assert step.cold.assist_workers == 0 and type(step.cold.assist) is CpuAssist
        # abandon froze the watermark: a job past it (as if queued) is not valid
        assert pool.finished_through() == last
        pool.close()  # the flags are gone: abandon's record answers
        assert pool.failure([last]) is None and pool.failure([last + 1]) is not None
    finally:
        pool.close()
        chunks.close()


@pytest.mark.parametrize("path", ["sync-free", "synchronous"])
def test_cpu_worker_processes_compute_the_deltas_and_a_dead_one_hands_over(tmp_path,
                                                                            monkeypatch, path):
    """cpu-assist on CpuWorkerPool (one worker process), the adapters read
    into shared chunks as the host tier's arena holds them: the workers read
    them in place (nothing staged), and the outputs equal block's. Then the
    worker is killed: the deltas after it run on the engine's threads and
    the worker count drops to 0. Synchronous (`delta`, where the op is
    missing on a GPU): the delta that finds it dead runs on the threads too,
    and no adapter fails. Sync-free: the batch in flight waits out the
    timeout and is not valid, so `collect` names cold, whose rows it held, and
    the next step fails it; cold2's jobs all finished before: it stays."""
    if path == "synchronous":
        monkeypatch.setattr(cold_mod, "enqueues", lambda assist, device: False)
    chunks = SharedChunks(pinned=False)
    adapters = make_adapters(tmp_path, shared_alloc(chunks))
    # The dead worker's batch waits out the timeout; 2 s needed luck on a loaded machine.
    pool = worker_pool(chunks, timeout_s=10.0)
    try:
        step = Step(adapters, "cpu-assist", cold=("cold", "cold2"), assist=pool)
        assert step.cold.assist_workers == 1 and step.cold.enqueues == (path == "sync-free")
        step.tokens(TOKENS)
        x, y0 = inputs()
        for layer in range(GROUP):  # group 0, on the workers
            for yb, yg in step.layer(layer, x, y0):
                torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
        assert pool.stats.jobs > 0 and pool.stats.staged_bytes == 0
        os.kill(pool.pids[0], signal.SIGKILL)
        for layer in range(GROUP, LAYERS):
            outs = step.layer(layer, x, y0)
            if layer == GROUP and path == "sync-free":
                outs = outs[1:]  # the batch that waited out the timeout
            for yb, yg in outs:
                torch.testing.assert_close(yg, yb, rtol=1e-5, atol=1e-5)
        assert step.cold.assisted_groups == 2 * (LAYERS // GROUP)
        assert step.cold.assist_workers == 0 and type(step.cold.assist) is CpuAssist
        step.cold.end_forward()
        collected = step.cold.collect()
        step.cold.begin_step()
        if path == "synchronous":
            assert not collected and not step.failed
        else:  # cold2 (no q/k/v) had no job in that batch: its deltas are all valid
            assert [load.lora_request.lora_int_id for load, _ in collected] == [10]
            assert list(step.failed) == [10] and 11 in step.grouped.slot_of
            assert "stopped waiting for CPU LoRA job" in step.failed[10]
    finally:
        pool.close()
        chunks.close()


@pytest.mark.parametrize("error", [RuntimeError("injected"),
                                   torch.cuda.OutOfMemoryError("injected")])
def test_a_group_write_that_fails_fails_its_adapter_alone(adapters, monkeypatch, error):
    """`fail` is given the error raised, which tells a transient one (out of
    memory: worker/paged_manager.py reports it once)."""
    write = DevicePool.write_group

    def failing(self, slot, group, streams):
        if slot == 2 and group == 1:
            raise error
        write(self, slot, group, streams)

    monkeypatch.setattr(DevicePool, "write_group", failing)
    step = Step(adapters, "pipelined", cold=("cold", "cold2"))
    step.tokens(TOKENS)
    x, y0 = inputs()
    rows = [i for i, t in enumerate(TOKENS) if t != 10]  # the failed adapter's rows aside
    for layer in range(LAYERS):
        for yb, yg in step.layer(layer, x, y0):
            torch.testing.assert_close(yg[rows], yb[rows], rtol=1e-5, atol=1e-5)
    assert list(step.failed) == [10] and "injected" in step.failed[10]
    assert step.errors[10] is error
    assert 10 not in step.grouped.slot_of and step.done == [3]


def test_group_spans_cover_exactly_the_groups_tensors(adapters):
    entry = adapters["cold"]
    size = entry.weights.data.numel()
    groups = layer_groups(LAYERS, GROUP)
    spans = group_spans(entry, groups)
    assert len(spans) == len(groups)
    union = np.zeros(size, dtype=int)
    for start, end in (span for group in spans for span in group):
        union[start:end] += 1
    every = np.zeros(size, dtype=int)
    for a, b in entry.weights.modules.values():
        for t in (a, b):
            every[t.offset:t.offset + math.prod(t.shape) * t.dtype.itemsize] = 1
    assert np.array_equal(union, every)  # every tensor byte in one group's spans, once
    for layers, group in zip(groups, spans, strict=True):
        covered = np.zeros(size, dtype=int)
        for start, end in group:
            covered[start:end] += 1
        tensors = np.zeros(size, dtype=int)
        for name, (a, b) in entry.weights.modules.items():
            if entry.where[name][0] in layers:
                for t in (a, b):
                    tensors[t.offset:t.offset + math.prod(t.shape) * t.dtype.itemsize] = 1
        assert tensors.any()
        assert np.array_equal(covered, tensors)  # each of its tensors' bytes once, nothing else


def test_layer_groups_and_the_one_queue_refusal(monkeypatch):
    assert layer_groups(6, 4) == (range(0, 4), range(4, 6))
    assert layer_groups(32, 4)[-1] == range(28, 32)
    with pytest.raises(ValueError):
        layer_groups(6, 0)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        cold_mod.refuse_one_hardware_queue("pipelined")
    cold_mod.refuse_one_hardware_queue("block")


def test_auto_is_pipelined_on_cuda_and_block_elsewhere(monkeypatch, caplog):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert cold_mod.resolve_mode("auto", cuda) == "pipelined"
    assert cold_mod.resolve_mode("auto", cpu) == "block"
    for mode in ("block", "pipelined", "cpu-assist"):  # a mode asked for is kept
        assert cold_mod.resolve_mode(mode, cpu) == mode
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with caplog.at_level("WARNING", logger=cold_mod.logger.name):
        assert cold_mod.resolve_mode("auto", cuda) == "block"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in caplog.text
    assert cold_mod.resolve_mode("pipelined", cuda) == "pipelined"  # refused at ColdStart
