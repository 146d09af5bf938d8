"""The sync-free CPU-assist op (csrc/assist_ops.cu) on a CUDA GPU (marker
`gpu`; needs no vLLM).

- A CPU thread stands in for the CPU LoRA: copy_to_host_and_flag hands it x,
  it computes the delta and flags it done, the stream's wait_host_flag then
  lets the result's copy and add run. The host enqueues all of it, and more
  work after it, before the CPU thread even starts computing (it waits for
  the host to finish enqueueing): any host wait on the stream in there would
  deadlock until the device wait's timeout, which the test would see. The
  torch.profiler trace of the enqueue holds the op, the copies and the
  launches, and no *Synchronize call, while the same trace does show the
  final torch.cuda.synchronize (so the profiler sees such calls).
- CpuWorkerPool.enqueue with real workers and weights read in place from a
  pinned shared arena equals the GPU reference (in fp32, three batches of
  256 rows, columns no block names left alone), again without a host sync.
- A dead worker does not hang the GPU: the device wait times out, the stream
  goes on, and pool.check() says what happened.

    export PYTHONPATH=$PWD/src
    python3 -m pytest -m gpu tests/gpu/test_assist_ops_gpu.py
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from vllm_loraserve.worker import assist_ops
from vllm_loraserve.worker.arena import PinnedArena
from vllm_loraserve.worker.cpu_lora.pool import Block, CpuPoolConfig, CpuWorkerPool, WorkerFailure
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks

pytestmark = pytest.mark.gpu
SYNC_WORDS = ("Synchronize",)  # cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize


@pytest.fixture(scope="module")
def ops():
    ok, why = assist_ops.available()
    assert ok, f"the csrc/ op must load on a CUDA machine: {why}"
    print(f"assist op: {why}")
    return assist_ops.ops()


def _host_events(prof):
    return [e for e in prof.events() if e.device_type == DeviceType.CPU]


def _in_range(events, name: str):
    """The host's events inside the record_function range `name`."""
    (outer,) = [e for e in events if e.name == name]
    start, end = outer.time_range.start, outer.time_range.end
    return [e for e in events if start <= e.time_range.start and e.time_range.end <= end]


def _host_syncs(events) -> list[str]:
    return [e.name for e in events if any(w in e.name for w in SYNC_WORDS)]


def _reference(x, a, bt, scaling):
    return ((x.float() @ a.float().T) * scaling) @ bt.float()


def _enqueue(ops, x, base, x_host, y_host, flags):
    """base + the CPU's delta of x, waited for on the device: flags[0] set
    when x is on the host, flags[1] awaited, flags[2] set on a timeout."""
    y = base.clone()
    ops.copy_to_host_and_flag(x, x_host, flags, 0, 1)
    ops.wait_host_flag(flags, 1, 1, 1, int(30e9), 2)
    y += y_host.to("cuda", non_blocking=True)
    return y, y.float().square().sum()  # later work enqueues without waiting


def test_cpu_result_round_trip_without_a_host_sync(ops):
    torch.manual_seed(0)
    n, k, m, r, scaling = 512, 4096, 4096, 16, 2.0
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)  # the base layer's output
    a = torch.randn(r, k, dtype=torch.bfloat16)
    b = (0.01 * torch.randn(m, r)).bfloat16()
    x_host = torch.empty(n, k, dtype=torch.bfloat16, pin_memory=True)
    y_host = torch.empty(n, m, dtype=torch.bfloat16, pin_memory=True)
    # 0: x ready, 1: delta ready, 2: timed out (cudaHostAlloc memory is mapped under UVA;
    # the pool's flags live in a pinned SharedSegment: the next test)
    flags = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    enqueued = threading.Event()
    seen: dict[str, float] = {}

    def cpu_lora():
        deadline = time.monotonic() + 60
        while flags[0].item() < 1 and time.monotonic() < deadline:
            time.sleep(20e-6)
        seen["x_ready"] = time.perf_counter()
        if not enqueued.wait(60):
            return
        seen["start"] = time.perf_counter()
        y_host.copy_(_reference(x_host, a, b.T, scaling).bfloat16())
        flags[1] = 1

    # CUDA loads a kernel at its first launch (lazy module loading), and that
    # load waits for the whole device, the flag wait included (on an H200 the
    # enqueue took the wait's 30 s timeout): each kernel runs once first, on
    # flags already set.
    _enqueue(ops, x, base, x_host, y_host, torch.ones(8, dtype=torch.int64, pin_memory=True))
    torch.cuda.synchronize()
    thread = threading.Thread(target=cpu_lora)
    thread.start()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function("enqueue"):
            y, after = _enqueue(ops, x, base, x_host, y_host, flags)
        enqueue_s = time.perf_counter() - t0
        pending = not torch.cuda.current_stream().query()
        enqueued.set()
        thread.join(120)
        torch.cuda.synchronize()
    assert not thread.is_alive()
    assert pending, ("the stream finished before the CPU result existed: nothing waited for "
                     f"it (flags {flags[:3].tolist()}: x ready, delta ready, timed out; "
                     f"enqueue {enqueue_s:.4f} s)")
    assert enqueue_s < 5.0 and seen["start"] > t0 + enqueue_s
    assert flags[:3].tolist() == [1, 1, 0]  # no device-side timeout
    expected = base + _reference(x, a.cuda(), b.T.cuda(), scaling).bfloat16()
    torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(after, y.float().square().sum())

    events = _host_events(prof)
    inside = _in_range(events, "enqueue")
    names = {e.name for e in inside}
    assert {"loraserve_assist::copy_to_host_and_flag",
            "loraserve_assist::wait_host_flag"} <= names, sorted(names)
    assert any("cudaMemcpyAsync" in name for name in names), sorted(names)
    assert any("LaunchKernel" in name for name in names), sorted(names)
    assert not _host_syncs(inside), _host_syncs(inside)
    assert _host_syncs(events), "the profiler recorded no synchronize call at all"


def _pool_setup(workers: int, timeout_s: float):
    chunks = SharedChunks(pinned=True)
    arena = PinnedArena(32 << 20, 1, pinned=True, make_chunk=chunks)
    cores = sorted(os.sched_getaffinity(0))
    cfg = CpuPoolConfig(cores=tuple(cores[-workers:]), max_rows=256, max_in=4096,
                        max_out=4096, timeout_s=timeout_s)
    return chunks, arena, CpuWorkerPool(cfg, weights=chunks.segments, pin=True)


def _arena_tensor(arena, t):
    nbytes = t.numel() * t.element_size()
    out = arena.view(arena.alloc(nbytes), nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_pool_enqueue_equals_the_gpu_reference_without_a_host_sync(ops):
    torch.manual_seed(1)
    chunks, arena, pool = _pool_setup(workers=min(4, len(os.sched_getaffinity(0))),
                                      timeout_s=30.0)
    try:
        n, k, m, r, scaling = 600, 4096, 4096, 32, 0.5  # 3 jobs of <= 256 rows
        a = _arena_tensor(arena, torch.randn(r, k).bfloat16())
        b = _arena_tensor(arena, (0.01 * torch.randn(m, r)).bfloat16())  # PEFT lora_B
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((n, m + 8), 3.0, device="cuda")  # 8 columns no block writes
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("enqueue"):
                jobs = pool.enqueue(x, [Block(0, n, 8, a, b.T, scaling)], out)
            torch.cuda.synchronize()
        pool.check()
        assert pool.failure(jobs[0]) is None and len(jobs[0]) == 3
        assert pool.stats.staged_bytes == 0
        delta = _reference(x, a.cuda(), b.T.cuda(), scaling)
        torch.testing.assert_close(out[:, 8:], delta, rtol=1e-3, atol=1e-3)
        assert (out[:, :8] == 3.0).all()
        inside = _in_range(_host_events(prof), "enqueue")
        assert not _host_syncs(inside), _host_syncs(inside)
        assert sum(e.name == "loraserve_assist::wait_host_flag" for e in inside) == 3
    finally:
        pool.close()
        chunks.close()


def test_a_dead_worker_lets_the_stream_go_on_and_is_reported(ops):
    chunks, arena, pool = _pool_setup(workers=1, timeout_s=2.0)
    try:
        a = _arena_tensor(arena, torch.randn(8, 1024))
        bt = _arena_tensor(arena, torch.randn(8, 1024))
        x = torch.randn(64, 1024, device="cuda")
        y = torch.zeros(64, 1024, device="cuda")
        os.kill(pool.pids[0], signal.SIGKILL)
        time.sleep(0.2)
        t0 = time.perf_counter()
        pool.enqueue(x, [Block(0, 64, 0, a, bt, 1.0)], y)
        torch.cuda.synchronize()  # returns: the device wait gave up after timeout_s
        assert 1.5 < time.perf_counter() - t0 < 30
        with pytest.raises(WorkerFailure, match="stopped waiting for CPU LoRA job 1"):
            pool.check()
    finally:
        pool.close()
        chunks.close()
