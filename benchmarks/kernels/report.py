"""Markdown table of a kernels benchmark result (per layer: qkv+o+gate_up+down),
with another run's speedup beside it when given.

    python benchmarks/kernels/report.py RESULTS.json [RERUN.json]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def per_layer(path: str) -> tuple[dict, dict]:
    d = json.load(open(path))
    layer: dict = defaultdict(lambda: {"ours": 0.0, "vllm": 0.0, "bytes": 0, "n": 0})
    for r in d["rows"]:
        cell = layer[(r["tokens"], r["mix"])]
        cell["ours"] += r["ours_us"]
        cell["vllm"] += r["vllm_us"]
        cell["bytes"] += r["bytes"]
        cell["n"] = r["adapters"]
    return d, layer


def main() -> None:
    d, layer = per_layer(sys.argv[1])
    rerun = per_layer(sys.argv[2])[1] if len(sys.argv) > 2 else None
    peak = d["peak_copy_bytes_per_s"]
    head = ("| T | mix | adapters | ours us | vLLM us | ours/vLLM speed | MB | ours % peak BW "
            "| vLLM % peak BW |")
    print(head + (" other run speed |" if rerun else ""))
    print("|" + "---|" * (head.count("|") - 1 + bool(rerun)))
    for (t, mix), c in layer.items():
        bw_o, bw_v = (100 * c["bytes"] / (us * 1e-6) / peak for us in (c["ours"], c["vllm"]))
        row = (f"| {t} | {mix} | {c['n']} | {c['ours']:.1f} | {c['vllm']:.1f} | "
               f"**{c['vllm'] / c['ours']:.2f}x** | {c['bytes'] / 1e6:.1f} | {bw_o:.1f} | "
               f"{bw_v:.1f} |")
        if rerun:
            r = rerun[(t, mix)]
            row += f" {r['vllm'] / r['ours']:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
