"""Workload generators (deterministic by seed). Each returns (catalogue, requests).

- `slora`: S-LoRA's synthetic benchmark, with the semantics of its published
  code (benchmarks/trace.py in the S-LoRA repository), which differ from the
  paper's prose: n adapters, ranks round-robin; aggregate arrivals are a Gamma
  renewal process of rate R and coefficient of variation cv (shape 1/cv^2,
  scale cv^2/R; the first request arrives after one interval); adapter index
  = floor(n * X) with X ~ numpy's power distribution with exponent alpha
  (density alpha * x^(alpha-1) on [0, 1]: alpha < 1 skews towards low
  indices, alpha = 1 is uniform); lengths uniform in [lo, hi). The draws come
  from numpy's legacy RandomState in S-LoRA's order (power, input lengths,
  output lengths, intervals), so a seed gives S-LoRA's own trace.
- `loraserve`: LoRAServe §V-E. Ranks (8, 16, 32, 64, 128) with an equal number
  of adapters each. Rank popularity is `uniform`, `shifting` (rank 128 has half
  the traffic at the start and rank 8 half at the end, linear in between,
  other ranks sharing the rest equally), `exponential` (each rank half as
  popular as the next smaller one) or `powerlaw` (rank k, counted from the
  smallest, has weight (k+1)^-rank_alpha). Within a rank, adapter j has weight
  (j+1)^-alpha (alpha = 1 in the paper). Arrivals: Poisson, or uniform
  (evenly spaced). Lengths: uniform ranges, or drawn from an Azure trace.
- `azure`: real arrivals and token counts from an Azure LLM inference trace,
  time rescaled to a target request rate (the arrival pattern is kept), with
  adapters assigned as in `loraserve`.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
from collections.abc import Sequence

import numpy as np

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.workloads.trace import Request

LORASERVE_RANKS = (8, 16, 32, 64, 128)
RANK_POPULARITIES = ("uniform", "shifting", "exponential", "powerlaw")
AZURE_CONV = os.path.join(os.path.dirname(__file__), "data", "azure_conv_2023.csv")


def slora(num_adapters: int, *, ranks: Sequence[int] = LORASERVE_RANKS, alpha: float = 1.0,
          rate: float = 1.0, cv: float = 1.0, duration: float = 60.0,
          input_range: tuple[int, int] = (8, 512), output_range: tuple[int, int] = (8, 512),
          seed: int = 42) -> tuple[list[AdapterRecord], list[Request]]:
    if alpha <= 0 or rate <= 0 or cv <= 0 or num_adapters <= 0:
        raise ValueError("num_adapters, alpha, rate and cv must be positive")
    catalog = [AdapterRecord(f"slora-{i:04d}-r{ranks[i % len(ranks)]}", ranks[i % len(ranks)])
               for i in range(num_adapters)]
    rs = np.random.RandomState(seed)  # S-LoRA seeds numpy's global (legacy) generator
    n = int(rate * duration)
    index = (rs.power(alpha, n) * num_adapters).astype(int)
    inputs = rs.randint(input_range[0], input_range[1], n)
    outputs = rs.randint(output_range[0], output_range[1], n)
    arrivals = np.cumsum(rs.gamma(1 / (cv * cv), cv * cv / rate, n))
    return catalog, [Request(i, float(arrivals[i]), catalog[index[i]].name,
                             catalog[index[i]].rank, int(inputs[i]), int(outputs[i]))
                     for i in range(n)]


def loraserve_catalog(num_adapters: int, ranks: Sequence[int] = LORASERVE_RANKS
                      ) -> list[AdapterRecord]:
    """`num_adapters` split as evenly as possible over the ranks."""
    per_rank = [num_adapters // len(ranks) + (k < num_adapters % len(ranks))
                for k in range(len(ranks))]
    return [AdapterRecord(f"r{rank}-{j:03d}", rank)
            for rank, count in zip(ranks, per_rank, strict=True) for j in range(count)]


def rank_shares(popularity: str, ranks: Sequence[int], progress: np.ndarray,
                rank_alpha: float = 1.0) -> np.ndarray:
    """[len(progress), len(ranks)] share of traffic per rank at each point of
    the trace (progress in [0, 1]); ranks sorted ascending."""
    k = len(ranks)
    if popularity == "uniform":
        base = np.full(k, 1 / k)
    elif popularity == "exponential":
        base = 0.5 ** np.arange(k)
    elif popularity == "powerlaw":
        base = (np.arange(k) + 1.0) ** -rank_alpha
    elif popularity == "shifting":
        start = np.full(k, 0.5 / (k - 1))
        start[-1] = 0.5
        end = np.full(k, 0.5 / (k - 1))
        end[0] = 0.5
        p = progress[:, None]
        return (1 - p) * start + p * end
    else:
        raise ValueError(f"unknown rank popularity {popularity!r}; choose from "
                         f"{RANK_POPULARITIES}")
    return np.broadcast_to(base / base.sum(), (len(progress), k))


def assign_adapters(rng: np.random.Generator, catalog: Sequence[AdapterRecord],
                    arrivals: np.ndarray, popularity: str, alpha: float,
                    rank_alpha: float = 1.0) -> list[AdapterRecord]:
    """Adapter of each request: a rank by its share at that time, then an
    adapter of that rank with weight (j+1)^-alpha."""
    ranks = sorted({a.rank for a in catalog})
    by_rank = {r: [a for a in catalog if a.rank == r] for r in ranks}
    within = {r: (np.arange(len(v)) + 1.0) ** -alpha for r, v in by_rank.items()}
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 1.0
    progress = (arrivals - arrivals[0]) / (span or 1.0)
    shares = rank_shares(popularity, ranks, progress, rank_alpha)
    u = rng.random(len(arrivals))
    rank_idx = np.minimum((u[:, None] > np.cumsum(shares, axis=1)).sum(axis=1), len(ranks) - 1)
    out: list[AdapterRecord] = [None] * len(arrivals)  # type: ignore[list-item]
    for k, rank in enumerate(ranks):
        rows = np.flatnonzero(rank_idx == k)
        w = within[rank]
        for row, j in zip(rows, rng.choice(len(w), size=len(rows), p=w / w.sum()), strict=True):
            out[row] = by_rank[rank][j]
    return out


def read_azure(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from the first request, prompt tokens, output tokens)."""
    times, prompts, outputs = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            stamp = row["TIMESTAMP"].strip()
            # Azure writes 7 fractional digits; datetime takes at most 6.
            head, _, frac = stamp.partition(".")
            times.append(dt.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}"))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    order = np.argsort(np.array(times, dtype="datetime64[us]"), kind="stable")
    t = np.array([times[i] for i in order], dtype="datetime64[us]")
    secs = (t - t[0]).astype(np.int64) / 1e6
    return secs, np.array(prompts)[order], np.array(outputs)[order]


def loraserve(num_adapters: int = 100, *, popularity: str = "uniform", arrival: str = "poisson",
              rate: float = 1.0, duration: float = 60.0, alpha: float = 1.0,
              rank_alpha: float = 1.0, input_range: tuple[int, int] = (8, 512),
              output_range: tuple[int, int] = (8, 512), lengths_from: str | None = None,
              seed: int = 0) -> tuple[list[AdapterRecord], list[Request]]:
    rng = np.random.default_rng(seed)
    n = int(rate * duration)
    if arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1 / rate, n))
    elif arrival == "uniform":
        arrivals = (np.arange(n) + 1) / rate
    else:
        raise ValueError(f"unknown arrival pattern {arrival!r}; choose poisson or uniform")
    if lengths_from:
        _, prompts, outputs = read_azure(lengths_from)
        pick = rng.integers(0, len(prompts), n)
        inputs, outs = prompts[pick], outputs[pick]
    else:
        inputs = rng.integers(input_range[0], input_range[1], n)
        outs = rng.integers(output_range[0], output_range[1], n)
    catalog = loraserve_catalog(num_adapters)
    adapters = assign_adapters(rng, catalog, arrivals, popularity, alpha, rank_alpha)
    return catalog, [Request(i, float(arrivals[i]), a.name, a.rank, int(inputs[i]), int(outs[i]))
                     for i, a in enumerate(adapters)]


def azure(num_adapters: int = 100, *, rate: float = 1.0, path: str = AZURE_CONV,
          duration: float | None = None, popularity: str = "uniform", alpha: float = 1.0,
          rank_alpha: float = 1.0, max_prompt_len: int | None = None,
          max_output_len: int | None = None, seed: int = 0
          ) -> tuple[list[AdapterRecord], list[Request]]:
    """Real arrivals rescaled so the trace's mean rate is `rate` requests/s,
    cut at `duration` seconds (after rescaling) if given. Lengths above the
    maxima are clipped (a small model's context may not hold the trace's)."""
    secs, prompts, outputs = read_azure(path)
    observed = (len(secs) - 1) / secs[-1]
    arrivals = secs * observed / rate
    if duration is not None:
        keep = arrivals <= duration
        arrivals, prompts, outputs = arrivals[keep], prompts[keep], outputs[keep]
    if max_prompt_len:
        prompts = np.minimum(prompts, max_prompt_len)
    if max_output_len:
        outputs = np.minimum(outputs, max_output_len)
    rng = np.random.default_rng(seed)
    catalog = loraserve_catalog(num_adapters)
    adapters = assign_adapters(rng, catalog, arrivals, popularity, alpha, rank_alpha)
    return catalog, [Request(i, float(arrivals[i]), a.name, a.rank, int(prompts[i]),
                             max(1, int(outputs[i])))
                     for i, a in enumerate(adapters)]
