"""The host's cost of the pool's LoRA path: microseconds of Python per
`DevicePool.add_lora` call, per module kind, as an eager engine step pays it.

vLLM replays CUDA graphs for steps of at most 512 tokens; larger steps (most
prefill steps under chunked prefill) launch every kernel from Python. There
a layer's LoRA launches cost host time, and where the host is slower than
the GPU work it paces the step. This times `add_lora` with the GPU kept far
ahead of the host: the step has 1 token, so the kernels finish long before
the next launch, and wall time over many calls is host time. It also
profiles the calls (cProfile) and prints where the host time goes.

    PYTHONPATH=src python benchmarks/kernels/launch_cost.py --out launch.json
    python benchmarks/kernels/launch_cost.py --baseline old_mbgmm.py --out launch.json

Needs torch and triton on a CUDA device; vLLM is not used.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import engine_grid  # noqa: E402

from vllm_loraserve.kernels.batch import ModuleSlices  # noqa: E402

CALLS = 2000


def host_us(pool, kind: str, dev: torch.device, calls: int = CALLS) -> tuple[float, str]:
    """(median over 5 rounds of µs per add_lora call, cProfile's top entries)."""
    m = ModuleSlices.of(pool.layout, engine_grid.MODULES[kind])
    x = torch.randn(1, m.in_features, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(1, sum(m.out_features), device=dev, dtype=torch.bfloat16)
    layers = engine_grid.LAYERS

    def run(n):
        for i in range(n):
            pool.add_lora(i % layers, m, x, y)

    run(50)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        run(calls)
        rounds.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    run(calls // 4)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    return sorted(rounds)[2], s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(engine_grid.SHAPES), default="llama3-8b")
    ap.add_argument("--targets", choices=sorted(engine_grid.TARGETS), default="all-linear")
    ap.add_argument("--baseline", help="a triton_mbgmm.py to compare with (same process)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from vllm_loraserve.kernels import triton_mbgmm as mbgmm

    dev = torch.device("cuda")
    shape, kinds = engine_grid.SHAPES[a.shape], engine_grid.TARGETS[a.targets]
    pool, _, _ = engine_grid.build(shape, kinds, "single-r64", 1, dev)
    pool.warm_up({ModuleSlices.of(pool.layout, engine_grid.MODULES[k]) for k in kinds})
    systems = {"new": mbgmm.TritonBackend()}
    if a.baseline:
        old = engine_grid.load_module(a.baseline, "baseline_mbgmm")
        systems = {"baseline": old.TritonBackend(), **systems}
    out = {"shape": a.shape, "targets": a.targets, "calls": CALLS,
           "gpu": torch.cuda.get_device_name(), "kinds": {}}
    for kind in kinds:
        row = out["kinds"][kind] = {}
        for name, backend in systems.items():
            pool.backend = backend
            us, prof = host_us(pool, kind, dev)
            row[f"{name}_host_us"] = round(us, 2)
            print(f"--- {kind} {name}: {us:.1f} us a call\n{prof}", flush=True)
    for name in systems:
        out[f"{name}_layer_host_us"] = round(sum(r[f"{name}_host_us"]
                                                 for r in out["kinds"].values()), 1)
    print(json.dumps(out))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
