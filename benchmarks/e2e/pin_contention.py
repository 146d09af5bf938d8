"""Does pinning host memory on other threads slow the engine thread's launches?

Session 7's pool-1000 profile (docs/benchmarks/e2e.md) found kernel launches
taking 163 us instead of ~13 us exactly while the host tier's readers pinned
new buffers (`cudaHostRegister`, 15.5 ms each). This isolates that: the main
thread launches small kernels in a loop and times them, while reader threads
allocate and fill pinned buffers as the host tier does (each a new ~100 MB
block: `torch.empty(pin_memory=True)` under the allocator settings the plugin
sets, or under torch's default cudaHostAlloc; new blocks stay allocated, as
in a filling tier). A third case is the host tier's arena (worker/arena.py,
`PinnedArena.for_budget` for two buffers per reader, pinned before the loop
under the plugin's allocator settings): each read takes an extent, fills it
and frees it, so no reader pins anything. Launch time is measured while the
readers run.

    PYTHONPATH=src python benchmarks/e2e/pin_contention.py --out pin.json

Needs torch on a CUDA device and this repository's src/ (for the arena); vLLM
is not used. Each case runs in a fresh process, since the pinned allocator's
settings are read once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

CASES = {
    "idle": "",  # no readers: the launches' own cost
    "register": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "hostalloc": "",  # torch's default pinned allocator (cudaHostAlloc)
    # The worker's arena, pinned up front as the plugin pins; readers only copy.
    "arena": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
}


def child(case: str, readers: int, buf_mb: int, total_gb: float) -> dict:
    import torch

    from vllm_loraserve.worker.arena import PinnedArena

    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    n = buf_mb << 20
    per_reader = max(1, int(total_gb * (1 << 30) / n / readers))
    arena = (PinnedArena.for_budget(readers * 2 * n, n, pinned=True)
             if case == "arena" else None)
    lock = threading.Lock()  # the arena is the host tier's, used under its lock
    src = torch.ones(n, dtype=torch.uint8)  # "the file"
    kept: list = []  # new blocks stay allocated, as in a filling tier

    def reader() -> None:
        for _ in range(per_reader):
            if arena is None:
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                kept.append(buf)
                buf.copy_(src)
                continue
            with lock:
                extent = arena.alloc(n)
            arena.view(extent, n).copy_(src)
            with lock:
                arena.free(extent)

    threads = [] if case == "idle" else [threading.Thread(target=reader)
                                         for _ in range(readers)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    launches, worst = 0, 0.0
    # Launch while the readers read (idle: for one second).
    while any(t.is_alive() for t in threads) or (not threads and time.perf_counter() - t0 < 1):
        t = time.perf_counter()
        x.add_(1.0)
        worst = max(worst, time.perf_counter() - t)
        launches += 1
        if launches % 64 == 0:
            torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    for t in threads:
        t.join()
    return {"case": case, "readers": len(threads), "reads": len(threads) * per_reader,
            "buf_mb": buf_mb, "seconds": round(dt, 2), "launches": launches,
            "us_per_launch": round(dt / launches * 1e6, 2),
            "worst_launch_ms": round(worst * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--buf-mb", type=int, default=100)
    ap.add_argument("--total-gb", type=float, default=8.0, help="bytes the readers read")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.readers, a.buf_mb, a.total_gb)))
        return
    results = []
    for case, conf in CASES.items():
        env = {**os.environ}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        out = subprocess.run([sys.executable, __file__, "--child", case, "--readers",
                              str(a.readers), "--buf-mb", str(a.buf_mb), "--total-gb",
                              str(a.total_gb), "--out", a.out], env=env, capture_output=True,
                             text=True, timeout=300)
        r = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {
            "case": case, "error": out.stderr[-2000:]}
        print(r, flush=True)
        results.append(r)
    json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
