#!/usr/bin/env python3
"""The engine thread's time to find a pipelined load's layer-group spans
(worker/cold_start.py `group_spans`: the byte ranges of each group's tensors
in the adapter's file, which each group copies to the device).

Host time only, on the CPU: a Llama-2-7B q/k/v/o adapter of rank 8 (32
layers, 256 tensors) written as PEFT files and read as the host tier reads
it, in groups of 4 layers. `--baseline` loads another worker/cold_start.py
into the same process, whose `group_spans(entry, layers)` took one group a
call (before session 26): it is timed once per group, as its caller did.

    PYTHONPATH=src python benchmarks/cold_start/group_spans_cost.py \
        --baseline old_cold_start.py --out spans.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import sys
import tempfile
import time

import torch

from vllm_loraserve.adapters.peft import read_weights, short_name
from vllm_loraserve.demo.assets import make_adapter
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.worker import cold_start
from vllm_loraserve.worker.host_tier import HostAdapter

LLAMA2 = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
              head_dim=128, intermediate_size=11008, num_hidden_layers=32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapter(root: str, rank: int) -> HostAdapter:
    cfg = type("Cfg", (), LLAMA2)
    layout = model_layout(cfg, 16 * 32 * 128)
    dims = {f"model.layers.{layer}.self_attn.{t}": (4096, 4096)
            for layer in range(LLAMA2["num_hidden_layers"]) for t in TARGETS}
    make_adapter(f"{root}/a", dims, rank=rank, alpha=2 * rank, seed=1, base_model="llama2")
    spec, raw = read_weights(f"{root}/a", lambda n: torch.empty(n, dtype=torch.uint8))
    where = {m: (int(re.search(r"layers\.(\d+)\.", m).group(1)), short_name(m))
             for m in raw.modules}
    return HostAdapter("a", layout.place(spec.rank, spec.target_modules), spec.scaling, raw,
                       where)


def per_load_ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="another worker/cold_start.py (one group a call)")
    ap.add_argument("--group-layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    groups = cold_start.layer_groups(LLAMA2["num_hidden_layers"], a.group_layers)
    with tempfile.TemporaryDirectory() as root:
        entry = adapter(root, 8)
    out = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "tensors": 2 * len(entry.weights.modules), "groups": len(groups)}
    runs = {"current": lambda: cold_start.group_spans(entry, groups)}
    if a.baseline:
        spec = importlib.util.spec_from_file_location("baseline_cold_start", a.baseline)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
        if runs["current"]() != [old.group_spans(entry, g) for g in groups]:
            raise SystemExit("the two give different spans")
        runs["baseline"] = lambda: [old.group_spans(entry, g) for g in groups]
    # ABBA, the faster of each's two runs: a busy machine slows one window.
    measured: dict[str, list[float]] = {name: [] for name in runs}
    for name in list(runs) + list(runs)[::-1]:
        measured[name].append(per_load_ms(runs[name], a.reps))
    times = {name: min(ms) for name, ms in measured.items()}
    out.update({f"{name}_ms_per_load": round(ms, 4) for name, ms in times.items()})
    if a.baseline:
        out["speed"] = round(times["baseline"] / times["current"], 2)
    print(json.dumps(out))
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
