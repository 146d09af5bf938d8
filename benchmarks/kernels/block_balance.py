"""How evenly a grid-stride launch's programs share a step's LoRA work, with
the work blocks in slot order or by decreasing rank (kernels/batch.py
BLOCK_ORDER). A model on the CPU, no GPU: it counts, it does not time.

The expand gives work block b to program b mod P on the grid's first axis
(P = `block_programs`: about PROGRAMS_PER_SM programs an SM over the other
axes' column tiles and slices), and each program loops over its blocks'
rank rows in `--rank-step`-row tiles. A launch lasts at least as long as
its heaviest program, so this reports, per module kind's P:
- `max_over_mean`: the heaviest program's tiles over the mean's;
- `makespan_over_ideal`: a list-scheduling model of the whole grid (every
  program of every column tile and slice, in launch order, on SMs x
  `--slots` resident programs, each taking its tiles plus `--overhead` a
  block) over perfect balance. Programs share bandwidth on a real GPU, so
  this bounds the tail's effect from above; only a GPU run measures it
  (engine_grid.py --block-orders rank,slot).

Steps: `--tokens` decode tokens over `--adapters` adapters with power-law
popularity (as the e2e protocol's and engine_grid.py's mixes), ranks drawn
from `--ranks`, slots assigned at random (as loads assign them).

    PYTHONPATH=src python benchmarks/kernels/block_balance.py --out balance.json
"""

from __future__ import annotations

import argparse
import heapq
import json

import numpy as np
import triton

from vllm_loraserve.kernels import batch as batch_mod
from vllm_loraserve.kernels.batch import TokenBatchBuffers
from vllm_loraserve.kernels.triton_mbgmm import PROGRAMS_PER_SM
from vllm_loraserve.worker.pool import plan

# Column tiles (128 columns) of each slice of each module kind's expand. Its grid
# has the widest slice's tiles for every slice; programs past a slice's own do nothing.
SHAPES = {
    "llama2-7b": {"qkv": (32, 32, 32), "o": (32,)},
    "llama3-8b": {"qkv": (32, 8, 8), "o": (32,), "gate_up": (112, 112), "down": (32,)},
}


def makespan(costs: list[float], workers: int) -> float:
    """Finish time of `costs` run in order, each on the first free worker."""
    free = [0.0] * workers
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def case(a: argparse.Namespace, order: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ranks = np.array(a.ranks)[rng.integers(0, len(a.ranks), a.adapters)]
    weights = 1.0 / np.arange(1, a.adapters + 1)
    token_slots = rng.permutation(a.adapters)[
        rng.choice(a.adapters, size=a.tokens, p=weights / weights.sum())]
    batch_mod.BLOCK_ORDER = order
    batch = TokenBatchBuffers(a.tokens, a.adapters, 16, max(a.ranks)).fill(token_slots, ranks)
    blocks = batch.blocks[:batch.num_blocks].numpy()
    tiles = -(-ranks[blocks[:, 0]] // a.rank_step) + a.overhead
    # The grid's first axis is bounded by the most blocks a step of this many
    # tokens can have (what its CUDA graph captured), not by this step's: the
    # pool's one batching of 16-token blocks (up to SMALL_BATCH tokens).
    (_, bound), = plan(a.tokens, a.adapters, "split")
    out = {"blocks": len(blocks)}
    for kind, slice_cols in SHAPES[a.shape].items():
        cols = max(slice_cols)
        programs = min(bound, triton.cdiv(PROGRAMS_PER_SM * a.sms, cols * len(slice_cols)))
        per = np.array([tiles[p::programs].sum() for p in range(programs)])
        grid = [float(c) if col < own else 0.0
                for own in slice_cols for col in range(cols) for c in per]
        out[kind] = {"programs": programs,
                     "max_over_mean": round(float(per.max() / per.mean()), 3),
                     "makespan_over_ideal": round(
                         makespan(grid, a.sms * a.slots) / (sum(grid) / (a.sms * a.slots)), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=660)
    ap.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")],
                    default=[8, 16, 32, 64, 128])
    ap.add_argument("--rank-step", type=int, default=16, help="rank rows a program's loop step")
    ap.add_argument("--overhead", type=float, default=1.0, help="tiles' worth a block costs")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--slots", type=int, default=16, help="resident programs an SM")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = [{"order": order, "seed": seed, **case(a, order, seed)}
            for seed in range(a.seeds) for order in ("slot", "rank")]
    for row in rows:
        print(json.dumps(row))
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
