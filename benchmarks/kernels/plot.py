"""Plot a kernels benchmark result: layer latency vs tokens, one panel per mix.

    python benchmarks/kernels/plot.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    results, out = json.load(open(sys.argv[1])), sys.argv[2]
    layer: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in results["rows"]:
        layer[(r["mix"], r["tokens"])][0] += r["ours_us"]
        layer[(r["mix"], r["tokens"])][1] += r["vllm_us"]
    mixes = list(dict.fromkeys(m for m, _ in layer))
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    for ax, mix in zip(axes.flat, mixes, strict=False):
        tokens = sorted(t for m, t in layer if m == mix)
        ax.plot(tokens, [layer[(mix, t)][0] for t in tokens], "o-", label="ours (paged, true rank)")
        ax.plot(tokens, [layer[(mix, t)][1] for t in tokens], "s--",
                label="vLLM (slots padded to max rank)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mix)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(mixes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("tokens in batch")
    for ax in axes[:, 0]:
        ax.set_ylabel("LoRA time per layer (us)")
    fig.suptitle(f"LoRA shrink+expand, one Llama-2-7B layer (qkv, o, gate_up, down), bf16, "
                 f"{results['device']}, vLLM {results['vllm']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
