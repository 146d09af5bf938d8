"""Placement policies: invariants, budgets, determinism, churn, packing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.cluster.placement import (
    POLICIES,
    PlacementInput,
    check_assignment,
    churn,
    get_policy,
    server_loads,
)
from vllm_loraserve.cluster.placement.loraserve import (
    LoRAServePlacement,
    fractional_bin_packing,
    rank_budgets,
)
from vllm_loraserve.workloads.generators import loraserve_catalog

OPS = {8: 40000.0, 16: 37000.0, 32: 32000.0, 64: 24000.0, 128: 17000.0}


def skewed(num_adapters=100, num_servers=8, seed=0, total=8 * 0.7 * 30000):
    """Power law within each rank, rank 8 most popular (halving per rank)."""
    catalog = loraserve_catalog(num_adapters)
    rng = np.random.default_rng(seed)
    weights = {}
    for a in catalog:
        j = int(a.name.split("-")[1])
        weights[a.name] = (j + 1.0) ** -1 * 0.5 ** [8, 16, 32, 64, 128].index(a.rank)
        weights[a.name] *= rng.uniform(0.8, 1.2)
    scale = total / sum(weights.values())
    return PlacementInput(catalog, {k: v * scale for k, v in weights.items()}, num_servers, OPS)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("num_servers", [1, 3, 8, 13])
def test_invariants_every_policy(policy, num_servers):
    inp = skewed(num_servers=num_servers)
    assignment = get_policy(policy, seed=3).place(inp)
    check_assignment(assignment, inp.adapters, num_servers)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 12), zero=st.floats(0, 1), seed=st.integers(0, 99))
def test_loraserve_invariants_property(n, k, zero, seed):
    """Any catalogue, any demand (including none): every adapter placed once
    or more, phi sums to 1."""
    catalog = loraserve_catalog(n)
    rng = np.random.default_rng(seed)
    demand = {a.name: 0.0 if rng.random() < zero else float(rng.exponential(5000))
              for a in catalog}
    assignment = LoRAServePlacement().place(PlacementInput(catalog, demand, k, OPS))
    check_assignment(assignment, catalog, k)


def test_check_assignment_catches_broken_invariants():
    inp = skewed(num_servers=4)
    good = LoRAServePlacement().place(inp)
    name = inp.adapters[0].name
    for broken, msg in ((dict(good, **{name: []}), "on no server"),
                        (dict(good, **{name: [(0, 0.5)]}), "sums to"),
                        (dict(good, **{name: [(9, 1.0)]}), "bad server"),
                        ({k: v for k, v in good.items() if k != name}, "misses")):
        with pytest.raises(ValueError, match=msg):
            check_assignment(broken, inp.adapters, 4)


def test_rank_budgets_round_and_never_exceed_servers():
    assert rank_budgets({8: 2.0, 16: 1.0, 128: 1.0}, 4) == {128: 1, 16: 1, 8: 2}
    assert sum(rank_budgets({8: 5.0, 16: 5.0, 32: 5.0}, 2).values()) <= 2
    assert rank_budgets({8: 0.0}, 3) == {8: 0}


def test_per_rank_budgets_respected():
    inp = skewed(num_servers=8)
    util = {a.name: inp.demand[a.name] / OPS[a.rank] for a in inp.adapters}
    rank_util = {}
    for a in inp.adapters:
        rank_util[a.rank] = rank_util.get(a.rank, 0.0) + util[a.name]
    budgets = rank_budgets(rank_util, 8)
    assert sum(budgets.values()) <= 8 and all(b >= 1 for b in budgets.values())
    plan = LoRAServePlacement().plan(inp)
    assert plan.budgets == budgets
    for rank, servers in plan.dedicated.items():
        assert len(servers) == budgets[rank]  # each rank packs into exactly its budget
        packed_on = {s for a in inp.adapters if a.rank == rank
                     for s in plan.packed.get(a.name, {})}
        assert packed_on <= set(servers), (rank, packed_on, servers)
    dedicated = [s for v in plan.dedicated.values() for s in v]
    assert len(dedicated) == len(set(dedicated))  # no server serves two ranks' budgets


def test_fractional_bin_packing_splits_and_returns_what_does_not_fit():
    loads = {0: 0.0, 1: 0.0}
    parts = {}
    left = fractional_bin_packing([("a", 1.5), ("b", 0.8)], [0, 1], 1.0, loads, parts)
    assert parts == {"a": {0: pytest.approx(1.0), 1: pytest.approx(0.5)},
                     "b": {1: pytest.approx(0.5)}}
    assert left == {"b": pytest.approx(0.3)}
    assert loads == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}


def test_leftovers_prefer_high_max_rank_servers_with_room():
    from vllm_loraserve.cluster.placement.loraserve import allocate_leftover

    loads, max_rank, parts = {0: 0.9, 1: 0.2, 2: 0.5}, {0: 128, 1: 8, 2: 64}, {}
    allocate_leftover("x", 8, 0.4, 1.0, loads, max_rank, parts, Counter())
    # server 0 (max rank 128) takes what fits (0.1), server 2 (64) the rest
    assert parts["x"] == {0: pytest.approx(0.1), 2: pytest.approx(0.3)}
    allocate_leftover("idle", 16, 0.0, 1.0, loads, max_rank, parts, Counter())
    assert parts["idle"] == {0: 0.0}  # no demand: whole, on the first choice


def test_leftover_overflow_never_raises_a_servers_max_rank_when_one_covers_it():
    from vllm_loraserve.cluster.placement.loraserve import allocate_leftover

    # A rank-64 overflow with room only on lower-rank servers stays on the
    # covering server (above target) instead of padding server 1 to rank 64.
    loads, max_rank, parts = {0: 1.0, 1: 0.3, 2: 0.2}, {0: 64, 1: 32, 2: 8}, {}
    allocate_leftover("big", 64, 0.3, 1.0, loads, max_rank, parts, Counter())
    assert parts["big"] == {0: pytest.approx(0.3)}
    assert max_rank == {0: 64, 1: 32, 2: 8}
    # a rank above every server's maximum may go anywhere with room
    allocate_leftover("huge", 128, 0.5, 1.0, loads, max_rank, parts, Counter())
    assert parts["huge"] == {1: pytest.approx(0.5)}
    assert max_rank[1] == 128


def test_adapters_without_demand_spread_over_covering_servers():
    inp = skewed(num_adapters=100, num_servers=4)
    idle = {a.name for a in inp.adapters if a.rank == 8}
    demand = {n: (0.0 if n in idle else d) for n, d in inp.demand.items()}
    assignment = LoRAServePlacement().place(PlacementInput(inp.adapters, demand, 4, OPS))
    per_server = Counter(s for n in idle for s, _ in assignment[n])
    assert len(per_server) > 1  # not all on the first choice
    # they fill the servers holding the fewest adapters (host memory)
    held = Counter(s for v in assignment.values() for s, _ in v)
    assert max(held[s] for s in per_server) - min(held[s] for s in per_server) <= 1


def test_cold_start_spreads_each_adapter_over_its_ranks_servers():
    """No demand measured: packing a uniform guess in any order would put a
    block of adapters (the hottest, if names follow popularity) on one server."""
    catalog = loraserve_catalog(100)
    guess = dict.fromkeys((a.name for a in catalog), 1.0)
    plan = LoRAServePlacement().plan(PlacementInput(catalog, guess, 8, OPS, cold=True))
    for a in catalog:
        servers = plan.dedicated[a.rank]
        if servers:
            assert plan.assignment[a.name] == [(s, pytest.approx(1 / len(servers)))
                                               for s in servers]
    check_assignment(plan.assignment, catalog, 8)
    warm = LoRAServePlacement().plan(PlacementInput(catalog, guess, 8, OPS))
    assert any(len(v) == 1 for v in warm.assignment.values())  # packing keeps them whole


def test_padded_kernels_cost_a_leftover_at_its_servers_max_rank():
    from vllm_loraserve.cluster.placement.loraserve import allocate_leftover

    def place(padded_ops):
        loads, max_rank, parts = {0: 0.5, 1: 0.6}, {0: 128, 1: 8}, {}
        allocate_leftover("x", 8, 0.4, 1.0, loads, max_rank, parts, Counter(), padded_ops)
        return parts["x"], loads

    parts, loads = place(None)  # the paper: own-rank units, all on the rank-128 server
    assert parts == {0: pytest.approx(0.4)} and loads[0] == pytest.approx(0.9)
    parts, loads = place(OPS)  # padded: each unit costs OPS[8] / OPS[128] on server 0
    c = OPS[8] / OPS[128]
    assert parts == {0: pytest.approx(0.5 / c), 1: pytest.approx(0.4 - 0.5 / c)}
    assert loads == {0: pytest.approx(1.0), 1: pytest.approx(1.0 - 0.5 / c)}


def test_rounded_down_rank_budget_overflow_stays_on_its_rank():
    """5 ranks on 4 servers: rank 128 needs 1.3 servers and gets 1; its
    overflow must not land on the rank-32/64 servers (docs/benchmarks/README.md)."""
    ranks = [8, 16, 32, 64, 128]
    catalog = [a for r in ranks for a in loraserve_catalog(25) if a.rank == r]
    util = {8: 0.3, 16: 0.9, 32: 1.0, 64: 1.0, 128: 1.3}  # in units of target
    demand = {a.name: util[a.rank] * OPS[a.rank] / sum(b.rank == a.rank for b in catalog)
              for a in catalog}
    plan = LoRAServePlacement().plan(PlacementInput(catalog, demand, 4, OPS))
    assert plan.budgets == {128: 1, 64: 1, 32: 1, 16: 1, 8: 0}
    rank = {a.name: a.rank for a in catalog}
    held = {s: max(rank[n] for n, e in plan.assignment.items() for t, _ in e if t == s)
            for s in range(4)}
    assert held == {plan.dedicated[r][0]: r for r in (128, 64, 32, 16)}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_deterministic(policy):
    inp = skewed(num_servers=5, seed=4)
    assert get_policy(policy, seed=7).place(inp) == get_policy(policy, seed=7).place(inp)


def test_bounded_churn_for_a_small_demand_change():
    inp = skewed(num_servers=8, seed=1)
    first = LoRAServePlacement().place(inp)
    rng = np.random.default_rng(2)
    nudged = {k: v * rng.uniform(0.95, 1.05) for k, v in inp.demand.items()}
    hinted = LoRAServePlacement().place(PlacementInput(inp.adapters, nudged, 8, OPS, first))
    cold = LoRAServePlacement().place(PlacementInput(inp.adapters, nudged, 8, OPS))
    assert churn(hinted, first) <= 0.1  # at most 10% of routing share moves
    assert churn(hinted, first) <= churn(cold, first)  # the permutation helps, never hurts


def _distinct_ranks_per_server(assignment, inp):
    ranks = {}
    for a in inp.adapters:
        if inp.demand[a.name] > 0:
            for s, _ in assignment[a.name]:
                ranks.setdefault(s, set()).add(a.rank)
    return np.mean([len(v) for v in ranks.values()])


def test_loraserve_packs_ranks_and_balances_load():
    inp = skewed(num_adapters=100, num_servers=8, seed=5)
    lora = LoRAServePlacement().place(inp)
    rand = get_policy("random", seed=5).place(inp)
    assert _distinct_ranks_per_server(lora, inp) < _distinct_ranks_per_server(rand, inp)
    loads = np.array(server_loads(lora, inp.adapters, inp.demand, OPS))
    assert loads.max() <= 1.2 * loads.mean() and loads.min() >= 0.8 * loads.mean()


def test_place_cli(tmp_path, capsys):
    import json

    from vllm_loraserve.cli.main import main
    from vllm_loraserve.perf.model import default_profile

    inp = skewed(num_adapters=20, num_servers=3)
    (tmp_path / "a.json").write_text(json.dumps([{"name": a.name, "rank": a.rank}
                                                 for a in inp.adapters]))
    (tmp_path / "d.json").write_text(json.dumps(inp.demand))
    profile = default_profile()
    profile.operating_points = OPS
    profile.save(tmp_path / "p.json")
    args = ["place", "--policy", "loraserve", "--adapters", str(tmp_path / "a.json"),
            "--demand", str(tmp_path / "d.json"), "--servers", "3", "--profile",
            str(tmp_path / "p.json")]
    main(args)
    first = json.loads(capsys.readouterr().out)
    check_assignment({k: [tuple(x) for x in v] for k, v in first.items()}, inp.adapters, 3)
    (tmp_path / "prev.json").write_text(json.dumps(first))
    main([*args, "--previous", str(tmp_path / "prev.json")])
    assert json.loads(capsys.readouterr().out) == first  # same demand: nothing moves
