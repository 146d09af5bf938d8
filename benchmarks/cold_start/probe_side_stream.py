"""Which main-stream operations wait for a busy side stream? A diagnostic for
the cold-start modes (docs/benchmarks/cold-start.md, session 16), not a test.

For each operation: the side stream sleeps ~1 s (torch.cuda._sleep), then
the operation runs on the main stream. Recorded: the host seconds the call
took (`host_s`: the host waited) and the seconds until an event recorded
after it on the main stream has passed (`main_s`: the main stream waited).
Either near 1 s means the operation waited for the side stream, which
pipelined and cpu-assist layers must never do.

    python3 benchmarks/cold_start/probe_side_stream.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

SLEEP_CYCLES = 2_000_000_000  # ~1 s at ~2 GHz


def measure(op) -> dict:
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    op()
    host = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    main = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"host_s": round(host, 4), "main_s": round(main, 4)}


def main() -> None:
    dev = torch.device("cuda")
    x = torch.randn(64, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    pageable = torch.arange(64)
    pinned = torch.arange(64).pin_memory()
    (x @ w).sum().item()  # the warm shape's kernels are loaded
    ops = {
        "nothing": lambda: None,
        "warm kernel (add)": lambda: x.add_(1),
        "mm, a shape already run": lambda: x @ w,
        "mm, a new shape (M=1777)": lambda: torch.randn(1777, 512, device=dev,
                                                        dtype=torch.bfloat16) @ w,
        "first launch of a kernel (cumsum int16)": lambda: torch.ones(
            8, dtype=torch.int16, device=dev).cumsum(0),
        "pageable H2D copy (.to(device))": lambda: pageable.to(dev),
        "pinned H2D copy, non_blocking": lambda: pinned.to(dev, non_blocking=True),
        "pageable D2H copy of a main-stream tensor": lambda: x[:1, :1].cpu(),
        "torch.empty (cached block)": lambda: torch.empty(1 << 20, device=dev),
        "torch.empty (new 2 GiB block: cudaMalloc)": lambda: torch.empty(1 << 31,
                                                                         device=dev),
        "cuda Event query": lambda: torch.cuda.Event().query(),
    }
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "sleep_cycles": SLEEP_CYCLES, "side_sleep_alone": measure(lambda: None)}
    for name, op in ops.items():
        out[name] = [measure(op) for _ in range(2)]
        print(name, out[name], flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
