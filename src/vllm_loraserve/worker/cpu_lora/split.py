"""Which rows each CPU worker computes: Toppings' profiling-guided
parallelism (§4.2, Fig. 17).

At start-up every worker times the same small GEMM on its own core, all at
once (as they will run), and reports rows/s (`profile_rows_per_s`). A job's
rows are then split in proportion to those speeds, over the fastest workers
only as many as give each at least `min_rows` rows: a few rows are not
worth waking a core for (Toppings sizes a request's cores as ceil(L / c)
from the same profile).
"""

from __future__ import annotations

import math
import time

import torch

# The profile's GEMM: a rank-16 delta of 64 rows over 1024 features, about
# the shape of one worker's share of a small prefill.
PROFILE_ROWS, PROFILE_FEATURES, PROFILE_RANK = 64, 1024, 16


def profile_rows_per_s(seconds: float = 0.05) -> float:
    """Rows/s of this process's core on the profile GEMM (fp32, one thread),
    the median of the runs that fit in `seconds` (at least 5)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROFILE_ROWS, PROFILE_FEATURES, generator=g)
    a = torch.randn(PROFILE_RANK, PROFILE_FEATURES, generator=g)
    bt = torch.randn(PROFILE_RANK, PROFILE_FEATURES, generator=g)
    (x @ a.T) @ bt  # warm-up: first-call allocations and dispatch
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        (x @ a.T) @ bt
        times.append(time.perf_counter() - t0)
    times.sort()
    return PROFILE_ROWS / max(times[len(times) // 2], 1e-9)


def split_rows(n: int, speeds: list[float], min_rows: int) -> list[tuple[int, int]]:
    """(start, end) per worker, covering [0, n) in worker order, each share
    proportional to its speed (largest remainders round), workers beyond the
    fastest max(1, n // min_rows) getting (start, start): empty."""
    if n < 0 or min_rows < 1 or not speeds or min(speeds) <= 0:
        raise ValueError(f"cannot split {n} rows over speeds {speeds} (min_rows {min_rows})")
    used = min(len(speeds), max(1, n // min_rows))
    fastest = sorted(range(len(speeds)), key=lambda w: (-speeds[w], w))[:used]
    total = sum(speeds[w] for w in fastest)
    exact = {w: n * speeds[w] / total for w in fastest}
    share = {w: math.floor(exact[w]) for w in fastest}
    for w in sorted(fastest, key=lambda w: (share[w] - exact[w], w))[:n - sum(share.values())]:
        share[w] += 1
    ranges, start = [], 0
    for w in range(len(speeds)):
        end = start + share.get(w, 0)
        ranges.append((start, end))
        start = end
    return ranges
