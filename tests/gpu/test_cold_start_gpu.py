"""--loraserve-cold-start pipelined and cpu-assist on a GPU (marker `gpu`;
run through the device tool), against block.

Layer level (the pool, the side stream, the Triton flag kernels): the side
stream is held back (torch.cuda._sleep) before a step's group writes, so a
pipelined layer must really wait, inside a captured CUDA graph too, and a
cpu-assist layer really finds its group not landed.

End to end (vLLM 0.26 defaults: bf16, torch.compile, CUDA graphs, the JIT
monitor in error mode): the three modes on the same requests, each against
HF + PEFT in fp32 within the bf16 tolerance of tests/gpu/test_pool_gpu.py,
with the side stream held back for the two new modes (tests/gpu/slow_side.py).
A cpu-assist step that ran under a CUDA graph would skip its CPU deltas and
fail the reference; results go to $LORASERVE_RESULTS_DIR/gpu_cold_start.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_loraserve.paging.layout import pack_layers
from vllm_loraserve.paging.step import PageLoad
from vllm_loraserve.worker.assist import CpuAssist
from vllm_loraserve.worker.cold_start import ColdStart, layer_groups
from vllm_loraserve.worker.pool import DevicePool

from ..e2e.reference import (
    IN_PROCESS,
    Bf16Tolerance,
    HFReference,
    adapter_effect,
    bf16_problems,
    logprob_deltas,
    run_vllm,
)
from ..worker.test_cold_start import (
    GROUP,
    KV_SHAPE,
    LAYERS,
    LAYOUT,
    MODULES,
    TOKENS,
    host_adapter,
    page_ids,
)
from .case import MAX_TOKENS, build_case

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
DTYPE = torch.bfloat16
# ~2 s of side-stream sleep (at ~2 GHz): longer than the layers take, with the first
# CPU deltas' start-up (0.25 s was not, on an H200: a cpu-assist layer found group 2 landed).
HOLD_CYCLES = 4_000_000_000
TOL = Bf16Tolerance()
# Side-stream sleep before each load step's group writes in the e2e test
# (~0.5 s): the host alone takes ~25 ms to queue 8 adapters' group writes
# (slow_side.py's probe, H200), and the 10 ms held until 2026-11-25 let every
# group land before layer 0 asked.
DELAY_CYCLES = 1_000_000_000


def pack(entry, layers, data):
    return pack_layers(LAYOUT, entry.placement, entry.layer_weights(layers, data),
                       entry.scaling, DTYPE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"warm": host_adapter(root, "warm", 16, ("q_proj", "v_proj", "down_proj"), 1,
                                 pin=True),
            "cold": host_adapter(root, "cold", 8, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"), 2,
                                 pin=True)}


class GpuStep:
    """A block pool and a grouped pool on the GPU, the warm adapter resident;
    cpu-assist's deltas on this process's threads unless `assist` says."""

    def __init__(self, adapters, mode, assist=None):
        self.pools = []
        for groups in ((), layer_groups(LAYERS, GROUP)):
            g = torch.Generator(device=DEV).manual_seed(9)
            kv = [torch.randn(KV_SHAPE, generator=g, device=DEV).to(DTYPE) for _ in range(LAYERS)]
            p = DevicePool(LAYOUT.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                           max_slices=3, backend="triton", device=DEV, layer_groups=groups)
            p.bind(kv)
            p.warm_up(set(MODULES))
            warm = adapters["warm"]
            p.load(0, 1, warm.placement, page_ids(warm, 1),
                   pack(warm, range(LAYERS), warm.weights.data.to(DEV)))
            self.pools.append(p)
        self.block, self.grouped = self.pools
        self.side = torch.cuda.Stream(DEV)
        self.failed = {}
        self.cold = ColdStart(mode, self.grouped, DEV, self.side, pack,
                              lambda load, why, error=None: self.failed.setdefault(load.slot, why),
                              lambda load, s: None, assist or CpuAssist())
        self.cold.warm_up(MODULES)
        self.grouped.gate = self.cold
        entry = adapters["cold"]
        self.load = PageLoad(2, SimpleNamespace(lora_int_id=10, lora_name="cold"),
                             entry.placement.rank, page_ids(entry, 30))
        self.entry = entry

    def start_cold(self, hold: bool):
        """The next step: the cold adapter loads whole in the block pool and
        by groups in the grouped one (held back on the side stream)."""
        self.block.load(2, 10, self.entry.placement, self.load.page_ids,
                        pack(self.entry, range(LAYERS), self.entry.weights.data.to(DEV)))
        self.cold.begin_step()
        if hold:
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(HOLD_CYCLES)
        self.cold.load([(self.load, self.entry)])

    def tokens(self, ids):
        ids = np.asarray([i if i in self.block.slot_of else 0 for i in ids])
        for p in self.pools:
            p.set_tokens(ids, ignored_ids=set())


def inputs(n):
    g = torch.Generator(device=DEV).manual_seed(0)
    return (torch.randn(n, 96, generator=g, device=DEV).to(DTYPE),
            torch.randn(n, 192, generator=g, device=DEV).to(DTYPE))


def run_layers(pool, x, ys):
    for layer in range(LAYERS):
        for m, module in enumerate(MODULES):
            pool.add_lora(layer, module, x[:, :module.in_features], ys[layer][m])


def fresh(y0):
    return [[y0[:, :sum(m.out_features)].clone() for m in MODULES] for _ in range(LAYERS)]


def assert_equal_outputs(got, want):
    """Within bf16 rounding of y and of the pages (the CPU delta is fp32 from
    the file's weights); a delta missing or counted twice is ~2 off."""
    for layer in range(LAYERS):
        for m in range(len(MODULES)):
            torch.testing.assert_close(got[layer][m].float(), want[layer][m].float(),
                                       rtol=5e-2, atol=5e-2)


def test_pipelined_waits_on_the_device_inside_a_cuda_graph(adapters):
    step = GpuStep(adapters, "pipelined")
    n = len(TOKENS)
    x, y0 = inputs(n)
    step.tokens(TOKENS)  # warm adapter only: the cold one is not loaded yet
    ys = fresh(y0)
    run_layers(step.grouped, x, ys)  # eager once before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(step.grouped, x, ys)
    waits = step.cold.flags.waits
    # The step that loads the cold adapter replays the graph: its layers
    # must wait for the held-back side stream's groups on the device.
    step.start_cold(hold=True)
    step.tokens(TOKENS)
    for layer in range(LAYERS):
        for m, module in enumerate(MODULES):
            ys[layer][m].copy_(y0[:, :sum(module.out_features)])
    graph.replay()
    want = fresh(y0)
    run_layers(step.block, x, want)
    torch.cuda.synchronize()
    assert_equal_outputs(ys, want)
    assert step.cold.flags.waits == waits  # a replay launches no host-side wait
    assert int(step.cold.flags.timeouts[0]) == 0 and not step.failed


@pytest.mark.parametrize("hold", [True, False])
def test_cpu_assist_on_the_gpu_equals_block(adapters, hold):
    step = GpuStep(adapters, "cpu-assist")
    step.start_cold(hold=hold)
    assert step.cold.force_eager
    n = len(TOKENS)
    x, y0 = inputs(n)
    step.tokens(TOKENS)
    got, want = fresh(y0), fresh(y0)
    run_layers(step.grouped, x, got)
    run_layers(step.block, x, want)
    torch.cuda.synchronize()
    assert_equal_outputs(got, want)
    if hold:  # nothing landed while the layers ran: every group on the CPU
        assert step.cold.assisted_groups == len(layer_groups(LAYERS, GROUP))
    # The next step (decode) runs on the kernels, pages in place.
    step.cold.end_forward()
    step.cold.begin_step()
    assert not step.cold.force_eager
    step.tokens(TOKENS[:4])
    got, want = fresh(y0[:4]), fresh(y0[:4])
    run_layers(step.grouped, x[:4], got)
    run_layers(step.block, x[:4], want)
    torch.cuda.synchronize()
    assert_equal_outputs(got, want)
    assert not step.failed


def test_sync_free_cpu_assist_equals_block_without_a_host_sync(tmp_path):
    """cpu-assist on the CPU worker processes with the csrc/ op: the adapters
    in pinned shared chunks (as the host tier's arena holds them), the side
    stream held back so every group runs on the CPU. The layers' host time
    holds no synchronize call (torch.profiler), and the outputs equal block's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from vllm_loraserve.worker.cpu_lora.pool import CpuPoolConfig, CpuWorkerPool
    from vllm_loraserve.worker.cpu_lora.shm import SharedChunks

    from ..worker.test_cold_start import shared_alloc

    chunks = SharedChunks(pinned=True)
    alloc = shared_alloc(chunks)
    adapters = {name: host_adapter(tmp_path, name, rank, targets, seed, alloc=alloc)
                for name, rank, targets, seed in (
                    ("warm", 16, ("q_proj", "v_proj", "down_proj"), 1),
                    ("cold", 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"), 2))}
    cores = sorted(os.sched_getaffinity(0))
    pool = CpuWorkerPool(CpuPoolConfig(cores=tuple(cores[-2:]), max_rows=64, max_in=96,
                                       max_out=192, max_rank=32, timeout_s=30.0),
                         weights=chunks.segments, pin=True)
    try:
        # Twice: the first round launches every kernel of the step once. CUDA
        # loads a kernel at its first launch, and that load waits for the
        # whole device, the held side stream included (probe_side_stream.py),
        # so the first round's groups may all have landed by the first layer.
        rounds = []
        for _ in range(2):
            step = GpuStep(adapters, "cpu-assist", assist=pool)
            assert step.cold.enqueues, "the sync-free path must be on: the op and pinned segments"
            marks = [("start", time.perf_counter())]
            step.start_cold(hold=True)
            n = len(TOKENS)
            x, y0 = inputs(n)
            step.tokens(TOKENS)
            got, want = fresh(y0), fresh(y0)
            marks.append(("inputs", time.perf_counter()))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("layers"):
                    run_layers(step.grouped, x, got)
            marks.append(("layers", time.perf_counter()))
            run_layers(step.block, x, want)
            torch.cuda.synchronize()
            assert_equal_outputs(got, want)
            # Host seconds to each mark: a wait for the held side stream shows here.
            rounds.append((step.cold.assisted_groups,
                           [(k, round(t - marks[0][1], 3)) for k, t in marks]))
        assert step.cold.assisted_groups == len(layer_groups(LAYERS, GROUP)), rounds
        step.cold.end_forward()
        torch.cuda.synchronize()  # the step's event has passed: collect takes it
        assert step.cold.collect() == [] and not step.cold._unchecked and not step.failed
        assert pool.stats.jobs > 0 and pool.stats.staged_bytes == 0
        events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
        (outer,) = [e for e in events if e.name == "layers"]
        inside = [e.name for e in events if outer.time_range.start <= e.time_range.start
                  and e.time_range.end <= outer.time_range.end]
        assert "loraserve_assist::wait_host_flag" in inside, sorted(set(inside))
        assert not [e for e in inside if "Synchronize" in e], sorted(set(inside))
    finally:
        pool.close()
        chunks.close()


# -- end to end ------------------------------------------------------------
# No prefix caching, so that a warm-round step holding the same requests as a
# measured one has its token count (and launches the same kernels). On
# 2026-11-26 the rounds' steps held different requests (one step of 1652
# tokens, then 1433 + 244: cold-start.md); vllm_generate.py now reads each
# round's adapters into host memory before it (not yet run on a GPU).
ENGINE = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 64,
          "gpu_memory_utilization": 0.5, "jit_monitor_mode": "error",
          "enable_prefix_caching": False}


def _problems(ref, reqs, outs) -> tuple[list[str], list[dict]]:
    problems, stats = [], []
    for req, out in zip(reqs, outs, strict=True):
        name = req.lora_name or "base"
        if len(out["token_ids"]) != MAX_TOKENS:
            problems.append(f"{name}: {out}")
            continue
        lp = ref.logprobs(req, out["token_ids"])
        d = logprob_deltas(lp, out)
        problems += bf16_problems(name, d, TOL)
        s = {"adapter": name, "max": max(d), "mean": sum(d) / len(d)}
        if req.lora_name is not None:
            s["effect"] = adapter_effect(ref, req, out["token_ids"], lp)
            if s["effect"] < 2 * TOL.mean:
                problems.append(f"{name}: the adapter's effect {s['effect']:.3f} is too "
                                "small for this test to see")
        stats.append(s)
    return problems, stats


def test_cold_start_modes_match_hf_peft_with_cuda_graphs(fixed_dir, tmp_path):
    model, reqs = build_case(fixed_dir("cold-start-gpu"))
    env = IN_PROCESS
    runs = {}
    for mode in ("block", "pipelined", "cpu-assist"):
        (tmp_path / mode).mkdir()
        engine = {**ENGINE, "additional_config": {"loraserve": {
            "cold_start": mode, "cold_start_group_layers": 1}}}
        extra = {} if mode == "block" else {"script": "../gpu/slow_side.py",
                                            "delay_cycles": DELAY_CYCLES}
        # A warm round first: in the first load step's forward (eager, 1768
        # tokens) the host waited for the whole side-stream hold before layer
        # 0, so every group had landed (probe, 2026-11-25); likely a kernel's
        # first launch (CUDA's lazy loading). The measured round repeats that
        # step's shape.
        runs[mode] = run_vllm(tmp_path / mode, model, reqs, engine, MAX_TOKENS, env=env,
                              dtype="bfloat16", warm_round=True, **extra)
    ref = HFReference(model, device="cuda")
    report, problems = {"tolerance": dataclasses.asdict(TOL)}, []
    for mode, run in runs.items():
        p, stats = _problems(ref, reqs, run["outputs"])
        problems += [f"{mode}: {x}" for x in p]
        report[mode] = {"pool": run["residency"]["pool"],
                        "warm_pool": run["warm_residency"]["pool"], "requests": stats}
    out_dir = os.environ.get("LORASERVE_RESULTS_DIR")
    if out_dir:
        json.dump(report, open(os.path.join(out_dir, "gpu_cold_start.json"), "w"), indent=1)
    assert not problems, "\n".join(problems)
    # The measured round's own counts (the pool's counters include the warm round's).
    pools = {mode: {k: v - run["warm_residency"]["pool"][k]
                    for k, v in run["residency"]["pool"].items() if isinstance(v, int)}
             for mode, run in runs.items()}
    assert pools["block"]["pipelined_groups"] == 0
    assert pools["pipelined"]["pipelined_groups"] > 0, pools["pipelined"]
    assert pools["pipelined"]["assisted_groups"] == 0
    assert pools["cpu-assist"]["assisted_groups"] > 0, pools["cpu-assist"]
    assert pools["cpu-assist"]["sync_free_jobs"] > 0, pools["cpu-assist"]  # the csrc/ op's path
