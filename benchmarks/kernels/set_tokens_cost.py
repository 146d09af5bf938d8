#!/usr/bin/env python3
"""The host's time per step in `DevicePool.set_tokens` (worker/pool.py): the
token -> slot map, then the tokens grouped into work blocks and jobs for each
token batch the step's layers read, copied to the kernels' buffers.

It runs on the engine's thread. With vLLM's async scheduling (on by default
in 0.26, with the plugin too) the host prepares a step while the GPU runs
the one before, so this time costs throughput only where the host paces the
GPU; it is CPU time the host tier's readers, which share the engine's GIL,
then do not get. The pool is built on the CPU with the torch backend: no
kernels run, only the host's work is timed. `--baseline` loads another worker/pool.py into
the same process for an A/B.

    PYTHONPATH=src python benchmarks/kernels/set_tokens_cost.py \
        --baseline old_pool.py --out set_tokens.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from engine_grid import load_module

from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.worker import pool as pool_mod

LLAMA2 = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
              head_dim=128, intermediate_size=11008, num_hidden_layers=32)
RANKS = (8, 16, 32, 64, 128)


def make_pool(module, slots: int, max_tokens: int):
    """A bound pool whose slots hold adapters of RANKS in turn (only the slot
    table's bookkeeping: no weights are written)."""
    cfg = type("Cfg", (), LLAMA2)
    layout = model_layout(cfg, 16 * 2 * 32 * 128)
    pool = module.DevicePool(layout.slices, 1, max_rank=128, max_tokens=max_tokens,
                             max_slots=slots, max_slices=3, backend="torch",
                             device=torch.device("cpu"))
    pool.bind([torch.zeros(4, 2, 16, 32 * 128, dtype=torch.bfloat16)])
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    for slot in range(slots):
        placement = pool.layout.place(RANKS[slot % len(RANKS)], names)
        pool.slots[slot] = module._Resident(slot + 1, placement, (), 0)
        pool.slot_of[slot + 1] = slot
    return pool


def time_steps(pool, ids: np.ndarray, reps: int) -> float:
    pool.set_tokens(ids, set())  # first call outside the timing
    t0 = time.perf_counter()
    for _ in range(reps):
        pool.set_tokens(ids, set())
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="256:1,256:100,1024:200,2048:200,8192:200",
                    help="tokens:adapters of each step timed")
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--baseline", help="a worker/pool.py to compare with (same process)")
    ap.add_argument("--out")
    a = ap.parse_args()
    systems = {"current": pool_mod}
    if a.baseline:
        systems = {"baseline": load_module(a.baseline, "baseline_pool"), **systems}
    rng = np.random.default_rng(0)
    rows = []
    for case in a.cases.split(","):
        tokens, adapters = map(int, case.split(":"))
        ids = rng.integers(1, adapters + 1, size=tokens)
        row = {"tokens": tokens, "adapters": adapters}
        for name, module in systems.items():
            pool = make_pool(module, max(adapters, 1), max(tokens, 8192))
            row[f"{name}_us"] = round(time_steps(pool, ids, a.reps), 1)
        rows.append(row)
        print(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"host": platform.processor() or platform.machine(),
                       "cpus": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
