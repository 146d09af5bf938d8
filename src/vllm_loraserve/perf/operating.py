"""Per-rank operating points (LoRAServe §IV-A): the most tokens/s one engine
sustains within the SLO when every request uses an adapter of that rank.

Found by simulation with the profile's own step model: a single engine, a
Poisson stream of requests of fixed lengths (default 512 prompt / 128 output
tokens, LoRAServe's Fig. 6 workload), bisection on the request rate for the
highest one whose P95 TTFT meets `slo["ttft_p95_s"]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.perf.model import Profile
from vllm_loraserve.workloads.trace import Request


def _p95_ttft(profile: Profile, rank: int, rate: float, prompt_len: int, output_len: int,
              n: int, seed: int) -> float:
    from vllm_loraserve.sim.cluster import ClusterConfig, simulate

    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    trace = [Request(i, float(t), "a", rank, prompt_len, output_len)
             for i, t in enumerate(arrivals)]
    probe = dataclasses.replace(profile, operating_points={rank: 1.0})
    result = simulate(trace, [AdapterRecord("a", rank)], probe,
                      ClusterConfig(num_engines=1, policy="contiguous", rebalance_s=None,
                                    max_time_s=float(arrivals[-1]) * 4))
    return result.summary()["ttft_p95_s"]


def operating_point(profile: Profile, rank: int, *, prompt_len: int = 512,
                    output_len: int = 128, n_requests: int = 1500, seed: int = 0) -> float:
    slo = profile.slo["ttft_p95_s"]
    ok = lambda rate: _p95_ttft(profile, rank, rate, prompt_len, output_len,  # noqa: E731
                                n_requests, seed) <= slo
    lo, hi = 0.0, 1.0
    while ok(hi):
        lo, hi = hi, hi * 2
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * (prompt_len + output_len)


def with_operating_points(profile: Profile, ranks: Sequence[int], **kw) -> Profile:
    """The profile with operating points for `ranks` filled in (kept if present)."""
    ops = dict(profile.operating_points)
    for r in sorted(set(ranks) - set(ops)):
        ops[r] = operating_point(profile, r, **kw)
    return dataclasses.replace(profile, operating_points=ops)
