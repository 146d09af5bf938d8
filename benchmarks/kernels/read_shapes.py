"""What read bandwidth a program's tile shape can reach on this GPU, with no
paging and no batching: every program streams R rows x (K / SPLIT) columns
of a bf16 matrix of K-column rows in [R, C] tiles (as the shrink reads an
A segment: rank rows of `in_features` elements), optionally through a
tensor-core dot with a 16-row x (as the shrink does). The ceiling the
LoRA kernels' access pattern has, before any of their own costs.

    python benchmarks/kernels/read_shapes.py --mb 600 --out shapes.json

Needs torch and triton on a CUDA device.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.language as tl
from engine_grid import copy_tb_s


@triton.jit
def _read_kernel(a_ptr, x_ptr, out_ptr, K, R: tl.constexpr, C: tl.constexpr,
                 SPLIT: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % SPLIT
    rows = (pid // SPLIT) * R + tl.arange(0, R)
    span = K // SPLIT
    cols = tl.arange(0, C)
    if DOT:
        acc = tl.zeros((16, R), dtype=tl.float32)
    else:
        acc = tl.zeros((R, C), dtype=tl.float32)
    for k0 in range(split * span, (split + 1) * span, C):
        w = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + k0 + cols[None, :])
        if DOT:
            x = tl.load(x_ptr + tl.arange(0, 16)[:, None] * K + k0 + cols[None, :])
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += w.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=600, help="bytes read per launch (MB)")
    ap.add_argument("--k", type=int, default=4096, help="row length (elements)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = a.mb * 10**6 // (2 * a.k) // 64 * 64
    mat = torch.randn(rows, a.k, device=dev, dtype=torch.bfloat16)
    x = torch.randn(16, a.k, device=dev, dtype=torch.bfloat16)
    copy = copy_tb_s(dev)
    print(f"copy: {copy:.2f} TB/s (read + write); {rows} rows of {a.k}", flush=True)
    results = []
    for r, c, split, dot, warps, stages in itertools.product(
            (16, 32, 64), (128, 256, 512), (1, 4), (0, 1), (4, 8), (2, 3)):
        if a.k % (split * c):
            continue
        out = torch.empty(rows // r * split, device=dev)
        launch = functools.partial(_read_kernel[(rows // r * split,)], mat, x, out, a.k, R=r,
                                   C=c, SPLIT=split, DOT=dot, num_warps=warps,
                                   num_stages=stages)
        try:
            ms = triton.testing.do_bench(launch, warmup=5, rep=40, return_mode="median")
        except Exception as e:  # out of resources: not a candidate
            print(f"R{r} C{c} split{split} dot{dot} w{warps} s{stages}: {type(e).__name__}")
            continue
        tb_s = mat.numel() * 2 / ms / 1e9
        row = dict(R=r, C=c, split=split, dot=dot, warps=warps, stages=stages,
                   iters=a.k // split // c, tb_s=round(tb_s, 3),
                   pct_copy=round(100 * tb_s / copy, 1))
        print(json.dumps(row), flush=True)
        results.append(row)
    json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "copy_tb_s": round(copy, 3), "rows": rows, "k": a.k, "results": results},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
