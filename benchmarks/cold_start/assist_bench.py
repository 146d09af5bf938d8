"""How fast the CPU workers compute a cold adapter's LoRA delta, and what the
sync-free op costs on a GPU (issue 24 items 3 and 4).

CPU (always): CpuWorkerPool.delta throughput, tokens/s, against the number
of workers, for one Llama-2-7B q/k/v/o projection (4096 -> 4096) at ranks
8/32/128 and 128/512/2048 tokens, bf16 rows and weights, fp32 maths and
result; the weights lie in a shared arena (read in place, as from the host
tier). Beside each, `torch` with as many intra-op threads in this process
(Toppings Fig. 17-right's "native" baseline). `pool` is a delta call: the
rows' copy in, the job, the result's copy out into the caller's buffer.
`in place` is the job alone, rows already in the io segment and the result
left there: what the GPU path (pool.enqueue) costs on the CPU side, where
the GPU copies rows in and results out.

GPU (where CUDA and the csrc/ op are there; skipped with the reason
otherwise):
- enqueue cost: host time of one copy_to_host_and_flag + wait_host_flag
  pair (the flag already satisfied), median of many;
- flag round trip: GPU time from a copy_to_host_and_flag of one row to the
  end of a wait_host_flag whose flag a CPU thread sets once it sees the
  first (CUDA events, the host synchronising between iterations only);
- pool.enqueue: GPU time of one projection's delta through the workers
  (rows down, compute, result up, add), per shape, beside
  pool.delta's host-side time and the GPU's own delta (x @ A^T @ B).

    python benchmarks/cold_start/assist_bench.py --out assist_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from vllm_loraserve.worker import assist_ops
from vllm_loraserve.worker.arena import ALIGN, PinnedArena
from vllm_loraserve.worker.cpu_lora.pool import Block, CpuPoolConfig, CpuWorkerPool
from vllm_loraserve.worker.cpu_lora.shm import SharedChunks, SharedSegment

H = 4096  # Llama-2-7B hidden size: q/k/v/o are 4096 -> 4096
# The round trip's CPU side: spins on the GPU's flag, answers on the next.
ANSWER = """
from vllm_loraserve.worker.cpu_lora.shm import SharedSegment
f = SharedSegment.attach({name!r}, 4096).view(0, 64).view(__import__("torch").int64).numpy()
seen = 0
while not f[3]:
    if f[0] > seen:
        seen = int(f[0])
        f[1] = seen
"""


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weights(arena: PinnedArena, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, H], B^T [r, H] as a view of B [H, r]) in the arena, bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((rank, H), (H, rank)):
        nbytes = shape[0] * shape[1] * 2
        t = arena.view(arena.alloc(nbytes), nbytes).view(torch.bfloat16).view(shape)
        t.copy_(torch.randn(shape, generator=g))
        out.append(t)
    return out[0], out[1].T


def native(x, a, bt, threads: int, reps: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return timed(lambda: ((x.float() @ a.float().T) * 0.5) @ bt.float(), reps)
    finally:
        torch.set_num_threads(before)


def cpu_grid(args, by_rank, chunks, cuda: bool) -> list[dict]:
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for w in args.workers:
        cfg = CpuPoolConfig(cores=tuple(cores[-w:]), max_rows=max(args.tokens), max_in=H,
                            max_out=H, max_rank=max(args.ranks))
        with CpuWorkerPool(cfg, weights=chunks.segments, pin=cuda) as pool:
            for r in args.ranks:
                a, bt = by_rank[r]
                for n in args.tokens:
                    x = torch.randn(n, H, generator=torch.Generator().manual_seed(n)).bfloat16()
                    y = torch.empty(n, H)
                    s_pool = timed(lambda x=x, a=a, bt=bt, y=y: pool.delta(x, a, bt, 0.5, out=y),
                                   args.reps)
                    pool.x_view(n, H, x.dtype).copy_(x)

                    def in_place(n=n, x=x, a=a, bt=bt):
                        pool.wait(pool.post(n, x.dtype, a, bt, 0.5, torch.float32,
                                            host_ready=True, notify=True, stage=False))

                    s_in_place = timed(in_place, args.reps)
                    s_native = native(x, a, bt, w, args.reps)
                    rows.append({"workers": w, "rank": r, "tokens": n, "pool_s": s_pool,
                                 "in_place_s": s_in_place, "torch_threads_s": s_native,
                                 "pool_tokens_per_s": n / s_pool,
                                 "in_place_tokens_per_s": n / s_in_place,
                                 "torch_threads_tokens_per_s": n / s_native})
                    print(f"workers {w:2d}  rank {r:3d}  tokens {n:4d}  pool "
                          f"{s_pool * 1e3:7.2f} ms {n / s_pool:8.0f} tok/s  in place "
                          f"{s_in_place * 1e3:7.2f} ms {n / s_in_place:8.0f} tok/s  torch x{w} "
                          f"{s_native * 1e3:7.2f} ms {n / s_native:8.0f} tok/s", flush=True)
            assert pool.stats.staged_bytes == 0  # weights read in place
    return rows


def gpu_part(args, by_rank, chunks) -> dict:
    ok, why = assist_ops.available()
    if not torch.cuda.is_available() or not ok:
        note = why if not ok else "no CUDA device"
        print(f"GPU part skipped: {note}")
        return {"skipped": note}
    ops = assist_ops.ops()
    out: dict = {"op": why, "device": torch.cuda.get_device_name()}
    flags = torch.zeros(8, dtype=torch.int64, pin_memory=True)  # mapped: cudaHostAlloc, UVA
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(1, H, dtype=torch.bfloat16, pin_memory=True)

    # Enqueue cost: the host's time per pair, the flag set by the pair itself.
    n = 2000
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        ops.copy_to_host_and_flag(x, dst, flags, 0, i)
        ops.wait_host_flag(flags, 0, i)
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    out["enqueue_pair_us"] = host * 1e6

    # Round trip: the GPU flags x, another process (as a CPU worker is) answers
    # on a second flag; the flags are in a pinned shared segment.
    seg = SharedSegment.create(4096, "bench-flags")
    seg.pin()
    flags = seg.view(0, 64).view(torch.int64)  # 0: GPU's, 1: answer, 2: timed out, 3: stop
    answerer = subprocess.Popen([sys.executable, "-c", ANSWER.format(name=seg.name)])
    try:
        trips = []
        for i in range(1, 301):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            ops.copy_to_host_and_flag(x, dst, flags, 0, i)
            ops.wait_host_flag(flags, 1, i, 1, int(10e9), 2)
            end.record()
            end.synchronize()
            trips.append(start.elapsed_time(end) * 1e3)
        assert int(flags[2]) == 0, "a round trip timed out"
    finally:
        flags[3] = 1
        answerer.wait(30)
        seg.close()
    trips = sorted(trips[50:])
    out["round_trip_us"] = {"median": statistics.median(trips), "min": trips[0],
                            "p90": trips[int(0.9 * len(trips))]}

    # pool.enqueue per shape, most workers.
    cores = sorted(os.sched_getaffinity(0))
    w = max(args.workers)
    cfg = CpuPoolConfig(cores=tuple(cores[-w:]), max_rows=max(args.tokens), max_in=H,
                        max_out=H, max_rank=max(args.ranks))
    shapes = []
    with CpuWorkerPool(cfg, weights=chunks.segments, pin=True) as pool:
        for r in args.ranks:
            a, bt = by_rank[r]
            a_gpu, bt_gpu = a.cuda(), bt.cuda()
            for n_tok in args.tokens:
                xg = torch.randn(n_tok, H, device="cuda", dtype=torch.bfloat16)
                y = torch.zeros(n_tok, H, device="cuda", dtype=torch.bfloat16)
                d = torch.zeros(n_tok, H, device="cuda")  # enqueue's fp32 result

                def gpu_time(fn) -> float:
                    times = []
                    for _ in range(args.reps + 1):
                        s, e = torch.cuda.Event(enable_timing=True), \
                            torch.cuda.Event(enable_timing=True)
                        s.record()
                        fn()
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e) / 1e3)
                    return statistics.median(times[1:])

                s_enqueue = gpu_time(lambda xg=xg, d=d, a=a, bt=bt, n=n_tok:
                                     pool.enqueue(xg, [Block(0, n, 0, a, bt, 0.5)], d))
                pool.check()
                s_gpu = gpu_time(lambda xg=xg, y=y, a=a_gpu, bt=bt_gpu:
                                 y.add_((((xg @ a.T) * 0.5) @ bt).bfloat16()))
                xc, yc = xg.cpu(), torch.empty(n_tok, H)
                s_delta = timed(lambda xc=xc, a=a, bt=bt, yc=yc: pool.delta(xc, a, bt, 0.5, out=yc),
                                args.reps)
                shapes.append({"workers": w, "rank": r, "tokens": n_tok, "enqueue_gpu_s": s_enqueue,
                               "delta_host_s": s_delta, "gpu_lora_s": s_gpu})
                print(f"GPU  workers {w:2d}  rank {r:3d}  tokens {n_tok:4d}  enqueue "
                      f"{s_enqueue * 1e3:8.2f} ms (GPU time)  delta {s_delta * 1e3:8.2f} ms  "
                      f"GPU's own {s_gpu * 1e3:7.3f} ms", flush=True)
    out["pool_enqueue"] = shapes
    print(f"enqueue pair {out['enqueue_pair_us']:.1f} us host time; round trip "
          f"{out['round_trip_us']['median']:.1f} us median GPU time")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    n_cores = len(os.sched_getaffinity(0))
    default_workers = sorted({1, 2, 4, 8, n_cores - 1} & set(range(1, n_cores + 1))) or [1]
    ap.add_argument("--workers", type=int, nargs="+", default=default_workers)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="assist_bench.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    chunks = SharedChunks(pinned=cuda)
    need = sum(2 * (-(-2 * H * r // ALIGN) * ALIGN) for r in args.ranks)  # A and B, bf16
    arena = PinnedArena(1 << (need - 1).bit_length(), 1, pinned=cuda, make_chunk=chunks)
    try:
        by_rank = {r: weights(arena, r, seed=r) for r in args.ranks}
        print(f"{cpu_name()}, {n_cores} cores; rows/tokens bf16, {H} -> {H}, median of "
              f"{args.reps}")
        rows = cpu_grid(args, by_rank, chunks, cuda)
        if cuda:
            gpu = gpu_part(args, by_rank, chunks)
        else:
            gpu = {"skipped": "no CUDA device"}
            print("GPU part skipped: no CUDA device")
    finally:
        chunks.close()
    out = {"date": datetime.date.today().isoformat(), "machine": cpu_name(),
           "cores": n_cores, "torch": torch.__version__, "hidden": H, "dtype": "bf16",
           "reps": args.reps, "cpu": rows, "gpu": gpu}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
