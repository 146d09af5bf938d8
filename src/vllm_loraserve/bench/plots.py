"""Plots of replay results (matplotlib, from the `bench` extra)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(results: Sequence[str], out: str) -> None:
    """TTFT and TPOT CDFs, one line per results file."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path in results:
        with open(path) as f:
            reqs = json.load(f)["requests"]
        for ax, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
            v = np.sort([r[key] for r in reqs if r[key] is not None])
            ax.plot(v, np.arange(1, len(v) + 1) / max(1, len(v)), label=path)
    for ax, name in zip(axes, ("TTFT (s)", "TPOT (s)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def latency_vs_rate(results: Sequence[str], out: str) -> None:
    """P50/P95 TTFT and mean TPOT against the measured request rate."""
    plt = _plt()
    rows = []
    for path in results:
        with open(path) as f:
            s = json.load(f)["summary"]
        rows.append((s["requests"] / max(s["duration_s"], 1e-9), s["ttft_s"], s["tpot_s"]))
    rows.sort(key=lambda r: r[0])
    rate = [r[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(rate, [r[1]["p50"] for r in rows], "o-", label="P50")
    axes[0].plot(rate, [r[1]["p95"] for r in rows], "s-", label="P95")
    axes[1].plot(rate, [r[2].get("mean", np.nan) for r in rows], "o-", label="mean")
    for ax, name in zip(axes, ("TTFT (s)", "TPOT (s)"), strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
