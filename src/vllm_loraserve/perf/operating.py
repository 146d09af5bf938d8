"""Per-rank operating points (LoRAServe §IV-A): the most tokens/s one engine
sustains within the SLO when every request uses an adapter of that rank.

Found by simulation with the profile's own step model: one engine
(perf/engine.py) alone, its adapter in host memory, a Poisson stream of
requests of fixed lengths (default 512 prompt / 128 output tokens, LoRAServe's
Fig. 6 workload), bisection on the request rate for the highest one whose P95
TTFT meets `slo["ttft_p95_s"]`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from vllm_loraserve.perf.engine import EngineConfig, SimEngine, SimRequest
from vllm_loraserve.perf.model import Profile, default_profile
from vllm_loraserve.workloads.trace import Request


def _p95_ttft(profile: Profile, rank: int, rate: float, prompt_len: int, output_len: int,
              n: int, seed: int) -> float:
    """P95 TTFT of one engine under the stream; requests still without a first
    token after 4x the last arrival count as infinitely late."""
    config = EngineConfig()
    if prompt_len + output_len > config.kv_capacity_tokens:
        raise ValueError("a request of these lengths never fits the engine's KV cache")
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    states = [SimRequest(Request(i, float(t), "a", rank, prompt_len, output_len))
              for i, t in enumerate(arrivals)]
    engine = SimEngine(0, profile, config)
    engine.preload("a", rank)
    horizon = float(arrivals[-1]) * 4
    step_end: float | None = None
    i = 0
    while i < n or step_end is not None:
        # an arrival and a step ending at the same time: the arrival first
        if i < n and (step_end is None or arrivals[i] <= step_end):
            if arrivals[i] > horizon:
                break
            engine.enqueue(states[i])
            i += 1
            if step_end is None:
                step_end = engine.start_step(float(arrivals[i - 1]))
        else:
            if step_end > horizon:
                break
            engine.end_step(step_end)
            step_end = engine.start_step(step_end)
    ttft = [r.first_token - r.req.arrival_s if r.first_token >= 0 else math.inf
            for r in states]
    return float(np.percentile(ttft, 95))


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


def load_profile(path: str | None, ranks: Iterable[int]) -> Profile:
    """The profile at `path` (default: the built-in model) with operating
    points for `ranks` (computed if missing)."""
    profile = Profile.load(path) if path else default_profile()
    return with_operating_points(profile, list(ranks))
