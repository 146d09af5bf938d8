"""The discrete-event simulator: queueing theory, batching mechanics,
conservation, routing and migration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.perf.engine import EngineConfig
from vllm_loraserve.perf.model import Profile, StepModel, default_profile
from vllm_loraserve.perf.operating import with_operating_points
from vllm_loraserve.sim.cluster import ClusterConfig, simulate
from vllm_loraserve.workloads import generators as g
from vllm_loraserve.workloads.trace import Request

OPS = {8: 40000.0, 16: 37000.0, 32: 32000.0, 64: 24000.0, 128: 17000.0}


@pytest.fixture(scope="module")
def default_with_ops():
    return with_operating_points(default_profile(), [8, 16, 32, 64, 128])


def _profile(**coef) -> Profile:
    c = {"intercept": 0.0, "prefill_tokens": 0.0, "decode_tokens": 0.0, "lora": 0.0, **coef}
    return Profile(StepModel("mbgmv", c), operating_points=dict(OPS))


@pytest.mark.parametrize("rho", [0.5, 0.65, 0.8])
def test_md1_mean_wait(rho):
    """One engine serving one request at a time in one constant-length step
    (prompt 1, output 1) under Poisson arrivals is an M/D/1 queue: mean wait
    rho * D / (2 * (1 - rho)) (Pollaczek-Khinchine)."""
    d = 0.01
    profile = dataclasses.replace(_profile(intercept=d), max_num_seqs=1)
    rate = rho / d
    arrivals = np.cumsum(np.random.default_rng(7).exponential(1 / rate, 100_000))
    trace = [Request(i, float(t), "a", 8, 1, 1) for i, t in enumerate(arrivals)]
    result = simulate(trace, [AdapterRecord("a", 8)], profile,
                      ClusterConfig(1, "contiguous", rebalance_s=None))
    wait = result.ttft().mean() - d
    assert wait == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.10)


def test_batching_timeline_by_hand():
    """Token budget 8, step = 1 s + 0.1 s per prompt token + 0.5 s per
    decoding request, free adapter loads. A (prompt 12, output 3) arrives at
    0, B (prompt 2, output 2) at 0.5."""
    profile = dataclasses.replace(
        _profile(intercept=1.0, prefill_tokens=0.1, decode_tokens=0.5), max_batched_tokens=8,
        adapter_bytes_per_rank=0.0)
    trace = [Request(0, 0.0, "a", 8, 12, 3), Request(1, 0.5, "a", 8, 2, 2)]
    r = simulate(trace, [AdapterRecord("a", 8)], profile,
                 ClusterConfig(1, "contiguous", rebalance_s=None)).requests
    # step 1 [0, 1.8]: A prefills 8 tokens. step 2 [1.8, 3.4]: A's last 4 and B's 2
    # prompt tokens: both first tokens at 3.4. step 3 [3.4, 5.4]: 2 decodes -> A's
    # second token, B's last. step 4 [5.4, 6.9]: A's last token.
    assert (r[0].first_token, r[1].first_token) == (pytest.approx(3.4), pytest.approx(3.4))
    assert (r[1].finish, r[0].finish) == (pytest.approx(5.4), pytest.approx(6.9))


def test_every_request_finishes_and_memory_is_released(default_with_ops):
    catalog, trace = g.loraserve(25, popularity="exponential", rate=40, duration=60,
                                 input_range=(16, 400), output_range=(4, 200), seed=3)
    profile = default_with_ops
    for policy in ("random", "contiguous", "loraserve", "toppings"):
        res = simulate(trace, catalog, profile, ClusterConfig(3, policy, rebalance_s=10))
        assert len(res.finished()) == len(trace), policy
        assert all(r.first_token >= r.req.arrival_s and r.finish >= r.first_token
                   for r in res.requests)
        assert all(e.kv_reserved == 0 and not e.running and not e.waiting for e in res.engines)


def test_requests_that_cannot_fit_are_rejected_not_stuck():
    trace = [Request(0, 0.0, "a", 8, 900, 200), Request(1, 0.1, "a", 8, 10, 5)]
    res = simulate(trace, [AdapterRecord("a", 8)], _profile(intercept=0.01),
                   ClusterConfig(1, "contiguous", rebalance_s=None,
                                 engine=EngineConfig(kv_capacity_tokens=1000)))
    assert [r.request_id for r in res.rejected] == [0]
    assert len(res.finished()) == 1


def test_toppings_avoids_the_engine_that_would_break_the_slo():
    from vllm_loraserve.cluster.placement.toppings import EngineView, ToppingsRouter

    model = StepModel("mbgmv", {"intercept": 0.01, "prefill_tokens": 1e-5,
                                "decode_tokens": 1e-4, "lora": 1e-6})
    router = ToppingsRouter(model, tbt_slo_s=0.05, avg_response_len=100)
    busy = EngineView(running=300, running_rank_sum=300 * 128, running_rank_max=128)
    light = EngineView(running=350, running_rank_sum=350 * 8, running_rank_max=8)
    # busy: 0.01 + 301e-4 + 38.5e-3 > 0.05; light stays under it with more requests
    assert router.route(128, 100, [0, 1], {0: busy, 1: light}) == 1
    assert router.route(8, 100, [0, 1], {0: EngineView(), 1: light}) == 0  # idle wins


def test_migrations_fetch_before_routing_switches(default_with_ops):
    catalog, trace = g.loraserve(50, popularity="shifting", rate=60, duration=300,
                                 input_range=(16, 256), output_range=(8, 64), seed=4)
    res = simulate(trace, catalog, default_with_ops, ClusterConfig(4, "loraserve",
                                                                   rebalance_s=30))
    s = res.summary()
    assert s["rebalances"] >= 9 and s["migrations"] > 0 and s["fetches"] > 0
    assert len(res.finished()) == len(trace)
    assert s["on_demand_fetches"] == 0  # routing moved only after the adapters arrived


def test_deterministic_by_seed(default_with_ops):
    catalog, trace = g.loraserve(20, rate=20, duration=30, seed=5)
    profile = default_with_ops
    runs = [simulate(trace, catalog, profile, ClusterConfig(2, "random", seed=9)).summary()
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_migration_unloads_drained_pairs_as_the_router_does(default_with_ops):
    """Demand shifts between ranks (shifting popularity), so rebalancing moves
    adapters; a pair routing left is unloaded once drained: at the end every
    engine holds exactly the adapters routed to it (and every adapter is routed)."""
    catalog, trace = g.loraserve(40, popularity="shifting", rate=30, duration=90,
                                 input_range=(16, 300), output_range=(4, 100), seed=5)
    res = simulate(trace, catalog, default_with_ops,
                   ClusterConfig(3, "loraserve", rebalance_s=10))
    assert res.migrations > 0 and len(res.finished()) == len(trace)
    assert set(res.assignment) == {a.name for a in catalog}
    for e in res.engines:
        routed_here = {a for a, entries in res.assignment.items() if e.index in dict(entries)}
        assert set(e.host.items) == routed_here, e.index
        assert set(e.gpu.items) <= routed_here
