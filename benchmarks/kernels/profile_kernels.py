"""Run one benchmark case's LoRA layer (ours, then vLLM) a few times so Nsight
Compute can profile the kernels:

    ncu --clock-control none --kernel-name regex:'^_shrink_kernel|^_expand_kernel' \
        --launch-skip 8 --launch-count 8 --section SpeedOfLight --section Occupancy \
        python benchmarks/kernels/profile_kernels.py --tokens 256 --mix r128

(our kernels only: vLLM's are `_lora_shrink_kernel`/`_lora_expand_kernel`). The first
iteration warms up (compilation, vLLM's pointer caches); the skip passes it.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_lora_kernels import MODULES, Case, backend_from


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--mix", default="r128")
    p.add_argument("--tiles", help="results JSON of a --tune run")
    p.add_argument("--iters", type=int, default=4)
    a = p.parse_args()
    tiles = json.load(open(a.tiles))["tiles"] if a.tiles else None
    case, backend = Case(a.tokens, a.mix), backend_from(tiles)
    for _ in range(a.iters):
        for module in MODULES:
            case.ours(backend, module)[0]()
            case.vllm(module)[0]()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
