"""CpuWorkerPool on the CPU: the maths against the torch reference, the
scaling convention, weights read in place from a shared arena, the rows
path the GPU takes (READY set by someone else), `enqueue`'s batches on the
CPU's HostOps, each job's own failure, failures that raise instead of
hanging, and a shutdown that leaves no process, descriptor or mapping."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer, read_layer
from vllm_loraserve.worker import assist_ops
from vllm_loraserve.worker.arena import PinnedArena
from vllm_loraserve.worker.cpu_lora.control import TIMED_OUT
from vllm_loraserve.worker.cpu_lora.pool import (
    AssistError,
    Block,
    CpuPoolConfig,
    CpuWorkerPool,
    WorkerFailure,
)
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks

CORES = tuple(sorted(os.sched_getaffinity(0)))[:2]
SMALL = dict(cores=CORES, max_rows=96, max_in=256, max_out=320, max_rank=64, min_rows=8)


def _memfds() -> list[str]:
    """This process's open descriptors of loraserve segments."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:loraserve-assist"):
            out.append(target)
    return out


def _mapped() -> list[str]:
    """This process's mappings of loraserve pool segments."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:loraserve-assist" in line]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reference(x, a, bt, scaling):
    return ((x.float() @ a.float().T) * scaling) @ bt.float()


@pytest.fixture(scope="module")
def arena():
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena(1 << 20, 2, pinned=False, make_chunk=chunks)
    yield arena, chunks
    chunks.close()


@pytest.fixture(scope="module")
def pool(arena):
    with CpuWorkerPool(CpuPoolConfig(**SMALL), weights=arena[1].segments) as pool:
        yield pool


def _in_arena(arena: PinnedArena, t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    extent = arena.alloc(nbytes)
    out = arena.view(extent, nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_workers_start_with_a_profile_and_leave_nothing_in_dev_shm(pool):
    assert len(pool.speeds) == len(CORES) and min(pool.speeds) > 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("loraserve")]
    assert set(_memfds()) == {"/memfd:loraserve-assist-control (deleted)",
                              "/memfd:loraserve-assist-io (deleted)"}


@pytest.mark.parametrize("n,k,m,r,x_dtype,w_dtype", [
    (1, 64, 48, 4, torch.float32, torch.float32),
    (37, 256, 320, 8, torch.bfloat16, torch.bfloat16),
    (96, 128, 256, 64, torch.float16, torch.bfloat16),
    (200, 256, 100, 16, torch.float32, torch.bfloat16),  # three jobs of <= 96 rows
    (0, 64, 64, 8, torch.float32, torch.float32),
])
def test_delta_equals_the_reference(pool, n, k, m, r, x_dtype, w_dtype):
    g = torch.Generator().manual_seed(n + k + m + r)
    x = torch.randn(n, k, generator=g).to(x_dtype)
    a = torch.randn(r, k, generator=g).to(w_dtype)
    bt = torch.randn(r, m, generator=g).to(w_dtype)
    y = pool.delta(x, a, bt, 0.25)
    assert y.shape == (n, m) and y.dtype == torch.float32
    torch.testing.assert_close(y, reference(x, a, bt, 0.25), rtol=1e-5, atol=1e-4)
    y16 = torch.full((n, m), float("nan"), dtype=torch.bfloat16)
    assert pool.delta(x, a, bt, 0.25, out_dtype=torch.bfloat16, out=y16) is y16
    torch.testing.assert_close(y16, reference(x, a, bt, 0.25).bfloat16())


def test_bt_is_unscaled_and_the_pool_applies_scaling(pool):
    """The files' B with scaling = alpha / r equals the pages' Bt (scaling
    folded in by paging/layout.py) with scaling 1; folding it twice is wrong."""
    r, k, m, scaling = 8, 128, 96, 2.0
    g = torch.Generator().manual_seed(3)
    a = torch.randn(r, k, generator=g).bfloat16()
    b = (0.1 * torch.randn(m, r, generator=g)).bfloat16()  # PEFT lora_B: [out, r]
    x = torch.randn(20, k, generator=g).bfloat16()
    layout = LayerLayout((SliceSpec("q_proj", k, m),), page_size=512, align=64)
    placement = layout.place(r, ["q_proj"])
    stream = pack_layer(layout, placement, {"q_proj": (a, b)}, scaling, torch.bfloat16)
    pages = stream.view(placement.num_pages, layout.page_size)
    a_pages, bt_scaled = read_layer(layout, placement, pages, range(placement.num_pages))["q_proj"]
    from_files = pool.delta(x, a, b.T, scaling)
    from_pages = pool.delta(x, a_pages, bt_scaled, 1.0)
    torch.testing.assert_close(from_files, reference(x, a, b.T, scaling))
    torch.testing.assert_close(from_pages, from_files, rtol=2e-2, atol=2e-2)  # Bt rounded once
    twice = pool.delta(x, a_pages, bt_scaled, scaling)
    assert not torch.allclose(twice, from_files, rtol=0.1, atol=0.1)


def test_weights_in_the_arena_are_read_in_place(pool, arena):
    r, k, m = 16, 256, 320
    g = torch.Generator().manual_seed(5)
    a = _in_arena(arena[0], torch.randn(r, k, generator=g).bfloat16())
    b = _in_arena(arena[0], torch.randn(m, r, generator=g).bfloat16())
    x = torch.randn(50, k, generator=g)
    staged = pool.stats.staged_bytes
    y = pool.delta(x, a, b.T, 0.5)  # b.T: a strided view, as the host tier holds B
    assert pool.stats.staged_bytes == staged
    torch.testing.assert_close(y, reference(x, a, b.T, 0.5), rtol=1e-5, atol=1e-4)
    pool.delta(x, a.clone(), b.T.contiguous(), 0.5)  # outside the arena: copied in
    assert pool.stats.staged_bytes == staged + (r * k + m * r) * 2


def test_weights_are_found_in_the_right_segment_among_many():
    """The segment lookup (a bisect over start addresses): a tensor at the
    start or the end of each of many segments, passed in an order that is
    neither their addresses' nor its reverse, is read from that segment at
    its offset; one outside them all is refused."""
    chunks = SharedChunks(pinned=False)
    arena = PinnedArena(1 << 16, 8, pinned=False, make_chunk=chunks)
    by_address = sorted(chunks.segments, key=lambda seg: seg.address)
    weights = [by_address[i] for i in (3, 0, 6, 1, 7, 2, 5, 4)]
    try:
        with CpuWorkerPool(CpuPoolConfig(**SMALL), weights=weights) as pool:
            for chunk in arena.chunks:
                for off in (0, chunk.numel() - 4 * 64 * 2):
                    a = chunk[off:off + 4 * 64 * 2].view(torch.bfloat16).view(4, 64)
                    loc_a, loc_bt = pool.in_place(a, a[:, :32])
                    seg = weights[loc_a.seg - 1]
                    assert seg.address == chunk.data_ptr()
                    assert (loc_a.off, loc_bt.seg, loc_bt.off) == (off, loc_a.seg, off)
                    x = torch.randn(5, 64)
                    torch.testing.assert_close(pool.delta(x, a, a[:, :32], 0.5),
                                               reference(x, a, a[:, :32], 0.5),
                                               rtol=1e-5, atol=1e-4)
            with pytest.raises(ValueError, match="outside"):
                pool.in_place(torch.randn(4, 64), torch.randn(4, 32))
    finally:
        chunks.close()


def test_rows_already_in_the_io_segment_are_not_copied(pool):
    g = torch.Generator().manual_seed(6)
    a, bt = torch.randn(4, 64, generator=g), torch.randn(4, 32, generator=g)
    x = pool.x_view(10, 64, torch.float32)
    x.copy_(torch.randn(10, 64, generator=g))
    expected = reference(x, a, bt, 1.0)
    torch.testing.assert_close(pool.delta(x, a, bt, 1.0), expected, rtol=1e-5, atol=1e-5)


def test_workers_wait_for_rows_flagged_ready_by_someone_else(pool, arena):
    """The GPU path without a GPU: the job is posted first, the rows and the
    READY flag come later from another thread, as copy_to_host_and_flag
    writes them; the workers compute only after the flag."""
    r, k, m, n = 8, 128, 64, 40
    g = torch.Generator().manual_seed(7)
    a = _in_arena(arena[0], torch.randn(r, k, generator=g))
    bt = _in_arena(arena[0], torch.randn(r, m, generator=g))
    x = torch.randn(n, k, generator=g)
    job = pool.post(n, torch.float32, a, bt, 0.5, torch.float32, host_ready=False,
                    notify=False, stage=False)
    time.sleep(0.3)
    assert pool.ctl.done().max() < job  # nobody went ahead without the rows

    def device():
        pool.x_view(n, k, torch.float32).copy_(x)
        pool.flags[pool.ctl.ready_index(job)] = job

    threading.Thread(target=device).start()
    pool.wait(job)
    torch.testing.assert_close(pool.y_view(n, m, torch.float32), reference(x, a, bt, 0.5),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="in place"):  # the GPU path reads weights in place
        pool.post(n, torch.float32, a.clone(), bt, 0.5, torch.float32, host_ready=False,
                  notify=False, stage=False)


def test_a_failing_job_raises_its_error_and_the_pool_goes_on(pool, arena):
    g = torch.Generator().manual_seed(8)
    a = _in_arena(arena[0], torch.randn(4, 64, generator=g))
    bt = _in_arena(arena[0], torch.randn(4, 64, generator=g))
    job = pool.post(30, torch.float32, a, bt, 1.0, torch.float32, host_ready=False,
                    notify=True, stage=False)
    pool.ctl.jobs[job % pool.layout.depth]["a_off"] = 1 << 40  # outside every segment
    pool.flags[pool.ctl.ready_index(job)] = job
    with pytest.raises(AssistError, match=f"failed job {job}: ValueError"):
        pool.wait(job)
    x = torch.randn(30, 64, generator=g)
    torch.testing.assert_close(pool.delta(x, a, bt, 1.0), reference(x, a, bt, 1.0),
                               rtol=1e-5, atol=1e-5)


def test_enqueue_batches_blocks_over_shared_rows(pool, arena):
    """Three adapters' slices over one set of rows (as a layer's cold
    adapters x a fused module's slices), 230 rows in three batches of <= 96:
    each block's rows and columns hold its delta, everything else is left as
    it was; one READY flag per batch, every job done and none failed."""
    g = torch.Generator().manual_seed(9)
    k, width = 128, 320
    x = torch.randn(230, k, generator=g).bfloat16()
    spans = [(0, 70, 0, 128, 8), (0, 70, 128, 64, 8), (70, 71, 0, 128, 16),
             (71, 230, 192, 128, 4), (71, 230, 0, 128, 4)]
    blocks = []
    for start, end, col, m, r in spans:
        a = _in_arena(arena[0], torch.randn(r, k, generator=g).bfloat16())
        b = _in_arena(arena[0], torch.randn(m, r, generator=g).bfloat16())
        blocks.append(Block(start, end, col, a, b.T, 0.5))
    out = torch.full((230, width), 7.0)
    jobs_before, staged = pool.stats.jobs, pool.stats.staged_bytes
    jobs = pool.enqueue(x, blocks, out)
    expected = torch.full((230, width), 7.0)
    for b in blocks:
        m = b.bt.shape[1]
        expected[b.start:b.end, b.col:b.col + m] = reference(x[b.start:b.end], b.a, b.bt, 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    # Rows 71-230 cross the batches' edges (96, 192): one job per batch.
    assert [len(j) for j in jobs] == [1, 1, 1, 3, 3]
    assert pool.stats.jobs - jobs_before == 9 and pool.stats.staged_bytes == staged
    pool.check()
    assert pool.failure([j for js in jobs for j in js]) is None
    with pytest.raises(ValueError, match="in place"):  # weights outside the arena
        pool.enqueue(x, [Block(0, 5, 0, blocks[0].a.clone(), blocks[0].bt, 1.0)], out)
    with pytest.raises(ValueError, match="do not fit"):
        pool.enqueue(x, [Block(0, 231, 0, blocks[0].a, blocks[0].bt, 1.0)], out)
    assert pool.stats.jobs - jobs_before == 9  # refused before anything was posted


def test_results_wider_than_max_out_go_in_fewer_rows_per_batch(pool, arena):
    """out 640 wide (a fused module's two 320-wide slices) against max_out
    320: 48 rows a batch, not 96, so the results fit the io segment."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(100, 64, generator=g)
    blocks = [Block(0, 100, col, _in_arena(arena[0], torch.randn(4, 64, generator=g)),
                    _in_arena(arena[0], torch.randn(4, 320, generator=g)), 1.0)
              for col in (0, 320)]
    out = torch.zeros(100, 640)
    jobs = pool.enqueue(x, blocks, out)
    assert [len(j) for j in jobs] == [3, 3]  # rows 0-48, 48-96, 96-100
    for b in blocks:
        torch.testing.assert_close(out[:, b.col:b.col + 320], reference(x, b.a, b.bt, 1.0),
                                   rtol=1e-5, atol=1e-4)


def test_abandon_releases_queued_waits_and_keeps_the_segments():
    """A job whose rows never come (a device that died, say): `abandon` kills
    the workers and releases the DONE flags, so a wait queued behind it
    returns at once; the pool stays broken, its segments readable until
    close()."""
    pool = CpuWorkerPool(CpuPoolConfig(**SMALL, timeout_s=60.0))
    a, bt = torch.randn(4, 64), torch.randn(4, 64)
    job = pool.post(8, torch.float32, a, bt, 1.0, torch.float32, host_ready=False,
                    notify=False, stage=True)
    pids = pool.pids
    pool.abandon()
    assert all(_gone(pid) for pid in pids)
    t0 = time.monotonic()
    assist_ops.HostOps.wait_host_flag(pool.flags, pool.layout.done0, job, len(pool.cores),
                                      int(60e9), TIMED_OUT)
    assert time.monotonic() - t0 < 20  # not the 60 s limit (generous: a loaded CI machine)
    assert pool.y_view(8, 64, torch.float32).shape == (8, 64)  # still mapped
    with pytest.raises(WorkerFailure):
        pool.check()
    pool.close()


def test_host_waits_return_at_once_after_an_earlier_one_gave_up():
    """As the GPU's wait kernel: once a wait has timed out (the TIMED_OUT
    flag is set), later waits on flags that will never come return at once."""
    flags = torch.zeros(8, dtype=torch.int64)
    t0 = time.monotonic()
    assist_ops.HostOps.wait_host_flag(flags, 2, 1, 2, int(0.2e9), 1)
    assert 0.2 <= time.monotonic() - t0 < 20 and flags[1] == 1
    t0 = time.monotonic()
    assist_ops.HostOps.wait_host_flag(flags, 4, 7, 1, int(30e9), 1)
    assert time.monotonic() - t0 < 15  # not the 30 s limit


def _post_failing(pool, a, bt, n=30):
    """A job whose a lies outside every segment: the workers fail it."""
    job = pool.post(n, torch.float32, a, bt, 1.0, torch.float32, host_ready=False,
                    notify=True, stage=False)
    pool.ctl.jobs[job % pool.layout.depth]["a_off"] = 1 << 40
    pool.flags[pool.ctl.ready_index(job)] = job
    return job


def test_each_job_keeps_its_own_failure(arena):
    """Two failures by the same workers, a good job between them, and a ring
    of 4 slots wrapped past the first failure: each job's failure is still
    its own (a worker's ERROR flag holds only its last)."""
    chunks = arena[1]
    with CpuWorkerPool(CpuPoolConfig(**SMALL, depth=4), weights=chunks.segments) as pool:
        g = torch.Generator().manual_seed(10)
        a = _in_arena(arena[0], torch.randn(4, 64, generator=g))
        bt = _in_arena(arena[0], torch.randn(4, 64, generator=g))
        bad1 = _post_failing(pool, a, bt)
        good = pool.post(30, torch.float32, a, bt, 1.0, torch.float32, host_ready=True,
                         notify=True, stage=False)
        bad2 = _post_failing(pool, a, bt)
        pool.wait(good)  # a job that did not fail raises nothing
        with pytest.raises(AssistError, match=f"failed job {bad2}: ValueError"):
            pool.wait(bad2)
        pool.wait(pool.post(30, torch.float32, a, bt, 1.0, torch.float32, host_ready=True,
                            notify=True, stage=False))
        bad3 = _post_failing(pool, a, bt)  # in bad1's slot
        assert bad3 % 4 == bad1 % 4
        with pytest.raises(AssistError, match=f"failed job {bad3}"):
            pool.wait(bad3)
        assert pool.ctl.flags[pool.ctl.failed_index(bad1)] == bad3
        assert f"failed job {bad1}" in pool.failure([good, bad1])
        assert pool.failure([good]) is None
        x = torch.randn(30, 64, generator=g)
        torch.testing.assert_close(pool.delta(x, a, bt, 1.0), reference(x, a, bt, 1.0),
                                   rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_before_any_job(pool):
    jobs = pool.stats.jobs
    with pytest.raises(ValueError):
        pool.delta(torch.randn(4, 64), torch.randn(4, 32), torch.randn(4, 8), 1.0)
    with pytest.raises(ValueError, match="max_in"):
        pool.delta(torch.randn(4, 512), torch.randn(4, 512), torch.randn(4, 8), 1.0)
    with pytest.raises(ValueError, match="max_rank"):
        pool.delta(torch.randn(4, 64), torch.randn(128, 64), torch.randn(128, 8), 1.0)
    with pytest.raises(ValueError, match="rank"):
        pool.delta(torch.randn(4, 64), torch.randn(4, 64), torch.randn(5, 8), 1.0)
    with pytest.raises(ValueError, match="out"):
        pool.delta(torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 8), 1.0,
                   out=torch.empty(4, 9))
    assert pool.stats.jobs == jobs


def test_a_killed_worker_fails_the_call_fast_and_close_cleans_up():
    pool = CpuWorkerPool(CpuPoolConfig(**SMALL, timeout_s=60.0))
    x, a, bt = torch.randn(64, 64), torch.randn(4, 64), torch.randn(4, 64)
    pool.delta(x, a, bt, 1.0)
    pids = pool.pids
    os.kill(pids[-1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match=f"worker {len(pids) - 1} .*died"):
        pool.delta(x, a, bt, 1.0)
    assert time.monotonic() - t0 < 20
    with pytest.raises(WorkerFailure, match="unusable"):
        pool.delta(x, a, bt, 1.0)
    pool.close()
    pool.close()
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(WorkerFailure):
        pool.delta(x, a, bt, 1.0)


def test_a_stuck_worker_times_out_instead_of_hanging():
    pool = CpuWorkerPool(CpuPoolConfig(**SMALL, timeout_s=1.0))
    try:
        os.kill(pool.pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match="did not finish job 1 within 1.0 s"):
            pool.delta(torch.randn(64, 64), torch.randn(4, 64), torch.randn(4, 64), 1.0)
        assert 1.0 <= time.monotonic() - t0 < 20
    finally:
        pool.close()  # kills the stopped worker
    assert all(_gone(pid) for pid in pool.pids)


ENGINE = """
import json, sys, time
from vllm_loraserve.worker.cpu_lora.pool import CpuPoolConfig, CpuWorkerPool
pool = CpuWorkerPool(CpuPoolConfig(cores={cores}, max_rows=8, max_in=64, max_out=64))
print(json.dumps(pool.pids), flush=True)
time.sleep(600)
"""


def test_workers_exit_with_their_engine():
    engine = subprocess.Popen([sys.executable, "-c", ENGINE.format(cores=CORES)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(engine.stdout.readline())
        assert pids and not any(_gone(pid) for pid in pids)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids)


def test_close_releases_descriptors_and_mappings():
    gc.collect()  # pools of earlier tests
    before_fds, before_maps = len(_memfds()), len(_mapped())
    pool = CpuWorkerPool(CpuPoolConfig(**SMALL))
    pool.delta(torch.randn(8, 64), torch.randn(4, 64), torch.randn(4, 64), 1.0)
    assert len(_memfds()) > before_fds
    pids = pool.pids
    pool.close()
    del pool  # the last views of the segments
    gc.collect()
    assert all(_gone(pid) for pid in pids)
    assert len(_memfds()) == before_fds and len(_mapped()) == before_maps
