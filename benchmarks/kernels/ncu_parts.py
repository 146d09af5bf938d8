"""One eager shrink and expand of each module kind on the engine's path,
between cudaProfilerStart/Stop, for Nsight Compute to read the hardware
counters of (memory throughput, occupancy, warp stalls):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section LaunchStats \\
        --csv --page details python3 benchmarks/kernels/ncu_parts.py --tokens 256 > parts.csv

Every kernel is launched once before the profiled region (Triton compiles
there), so the region holds only the launches of one step's layer.
Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse

import torch
from engine_grid import MODULES, SHAPES, TARGETS, build

from vllm_loraserve.kernels.batch import ModuleSlices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all-linear")
    ap.add_argument("--mix", default="pow-200")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    dev = torch.device("cuda")
    pool, _, distinct = build(SHAPES[a.shape], TARGETS[a.targets], a.mix, a.tokens, dev)
    print(f"{a.tokens} tokens, {distinct} distinct adapters", flush=True)
    calls = []
    for kind in TARGETS[a.targets]:
        m = ModuleSlices.of(pool.layout, MODULES[kind])
        x = torch.randn(a.tokens, m.in_features, device=dev, dtype=torch.bfloat16)
        y = torch.zeros(a.tokens, sum(m.out_features), device=dev, dtype=torch.bfloat16)
        calls.append(lambda m=m, x=x, y=y: pool.add_lora(0, m, x, y))
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
