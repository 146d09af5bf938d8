"""Where a layer's LoRA time goes: shrink and expand timed apart, ours and
vLLM's, next to the time of the unavoidable activation traffic (an in-place
scale of y, which reads and writes it once, as the expand must), with the
same CUDA-graph method as bench_lora_kernels.py.

    python benchmarks/kernels/breakdown.py --tiles R.json --cases 512:r8 256:r128 \
        --out breakdown.json [--sweep prefill/expand ...]

`--sweep PHASE/OP` also times that op alone over a grid of tile sizes on
the cases of its phase (the summed layer time picks the best).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from bench_lora_kernels import DECODE_T, MODULES, Case, backend_from, bench

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.triton_mbgmm import Tiles, TritonBackend

GRIDS = {
    "decode/shrink": [Tiles(bn, bk, sk, 4, st) for bn, bk, sk, st in itertools.product(
        (16, 32), (128, 256), (0, 16, 32), (2, 4))],
    "decode/expand": [Tiles(bn, bk, 1, 4, st) for bn, bk, st in itertools.product(
        (64, 128, 256), (16, 32, 64), (2, 4))],
    "prefill/shrink": [Tiles(bn, bk, sk, w, 3) for bn, bk, sk, w in itertools.product(
        (32, 64, 128), (64, 128), (0, 1), (4, 8))],
    "prefill/expand": [Tiles(bn, bk, 1, w, st) for bn, bk, w, st in itertools.product(
        (64, 128, 256), (16, 32), (4, 8), (2, 3))],
}


def parts(case: Case, backend, module: str, copy: int) -> dict:
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    m = ModuleSlices.of(case.layout, MODULES[module])
    h = torch.zeros(m.count, case.t, case.max_rank, dtype=torch.float32, device=case.device)
    x, y, pool = case.x[module], case.y0[module].clone(), case.pools[copy]
    a_all, b_all = case.vllm_copies[copy]
    a = [a_all[n] for n in MODULES[module]]
    b = [b_all[n] for n in MODULES[module]]
    args = case.meta.meta_args(case.t, False)
    return {
        "ours_shrink": lambda: backend.shrink(x, pool, h, case.batch, case.slots, m, case.layout),
        "ours_expand": lambda: backend.expand(h, pool, y, case.batch, case.slots, m, case.layout),
        "vllm_shrink": lambda: lora_shrink(x, a, h, *args, 1.0),
        "vllm_expand": lambda: lora_expand(h, b, y, *args, offset_start=0, add_inputs=True),
        "y_rmw": lambda: y.mul_(1.0),
    }


def sweep(op: str, cases: list[Case], tiles: dict | None, log) -> list[dict]:
    phase, kind = op.split("/")
    mine = [c for c in cases if (c.t in DECODE_T) == (phase == "decode")]
    out = []
    for cand in GRIDS[op]:
        base = backend_from(tiles)
        if kind == "shrink":
            backend = TritonBackend(shrink_tiles=lambda b, k, t=cand: t,
                                    expand_tiles=base._rules["expand"])
        else:
            backend = TritonBackend(shrink_tiles=base._rules["shrink"],
                                    expand_tiles=lambda b, t=cand: t)
        row = {"op": op, "tiles": cand.__dict__, "us": {}}
        try:
            for c in mine:
                row["us"][f"{c.t}:{c.mix}"] = sum(
                    bench([parts(c, backend, m, k)[f"ours_{kind}"] for k in range(c.copies)],
                          rep=40) for m in MODULES)
        except Exception as e:  # a tile that does not compile or fit
            print(f"{op} {cand}: failed ({type(e).__name__})", flush=True)
            continue
        row["total_us"] = sum(row["us"].values())
        print(f"{op} {cand}: " + " ".join(f"{k}={v:.1f}" for k, v in row["us"].items()),
              flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
        out.append(row)
    out.sort(key=lambda r: r["total_us"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", help="results JSON of a --tune run")
    p.add_argument("--cases", nargs="+", default=["512:r8", "512:uniform", "256:r128"],
                   help="TOKENS:MIX")
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", nargs="*", default=[], choices=sorted(GRIDS))
    a = p.parse_args()
    tiles = json.load(open(a.tiles))["tiles"] if a.tiles else None
    backend = backend_from(tiles)
    rows, cases = [], []
    for spec in a.cases:
        t, mix = spec.split(":")
        case = Case(int(t), mix)
        cases.append(case)
        for module in MODULES:
            fns = [parts(case, backend, module, c) for c in range(case.copies)]
            row = {"tokens": case.t, "mix": mix, "module": module}
            for name in fns[0]:
                row[name + "_us"] = bench([f[name] for f in fns])
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    result = {"device": torch.cuda.get_device_name(), "tiles": tiles, "rows": rows,
              "sweeps": {}}
    json.dump(result, open(a.out, "w"), indent=1)
    log = open(a.out + ".sweep.jsonl", "a")  # as it goes: a run cut short keeps its rows
    for op in a.sweep:
        result["sweeps"][op] = sweep(op, cases, tiles, log)
        print(f"best {op}: " + json.dumps(result["sweeps"][op][:3]), flush=True)
        json.dump(result, open(a.out, "w"), indent=1)
    json.dump(result, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
