"""The migration planner shared by the router and the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.cluster import migration
from vllm_loraserve.cluster.placement import get_policy

OPS = {8: 40000.0, 64: 24000.0}
CATALOG = {"a": 8, "b": 8, "c": 64, "d": 64}


class Recording:
    """A policy that records its input and puts every adapter on index 0."""

    def __init__(self):
        self.inputs = []

    def place(self, inp):
        self.inputs.append(inp)
        return {a.name: [(0, 1.0)] for a in inp.adapters}


def test_place_without_demand_is_cold_and_maps_live_engines():
    policy = Recording()
    previous = {"a": [(3, 0.5), (7, 0.5)], "b": [(3, 1.0)]}  # engine 3 died
    new = migration.place(policy, CATALOG, None, [5, 7], previous, OPS, padded=False)
    inp = policy.inputs[0]
    assert inp.cold and inp.demand == dict.fromkeys(CATALOG, 1.0)
    assert [a.name for a in inp.adapters] == sorted(CATALOG) and inp.num_servers == 2
    assert inp.previous == {"a": [(1, 0.5)]}  # engine 7 is index 1; b had no live engine
    assert new == dict.fromkeys(CATALOG, [(5, 1.0)])  # index 0 is engine 5
    migration.place(policy, CATALOG, {"a": 3.0}, [5, 7], {}, OPS, padded=True)
    assert not policy.inputs[1].cold and policy.inputs[1].padded


def test_a_round_ensures_new_pairs_routes_to_holders_and_unloads_the_rest():
    old = {"a": [(0, 1.0)], "b": [(1, 1.0)], "gone": [(0, 1.0)]}
    holders = {"a": {0}, "b": {1}, "gone": {0}}
    new = {"a": [(0, 0.5), (1, 0.5)], "b": [(0, 1.0)], "gone": [(1, 1.0)]}
    assert migration.to_ensure(new, holders) == [("a", 1), ("b", 0), ("gone", 1)]
    holders["a"].add(1)  # b's load onto 0 failed
    routed = migration.route(new, holders, old, catalog={"a", "b"})
    assert routed == {"a": [(0, 0.5), (1, 0.5)], "b": [(1, 1.0)]}  # b keeps its old route
    assert migration.to_unload(routed, holders) == [("gone", 0)]


# No deadline: the CI machine's 2 shared cores make example timings meaningless.
@settings(deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.tuples(
    st.frozensets(st.integers(0, 3)),  # holders
    st.lists(st.tuples(st.integers(0, 3), st.floats(0.01, 1.0)), min_size=1, max_size=4,
             unique_by=lambda x: x[0]),  # new entries
    st.lists(st.tuples(st.integers(0, 3), st.floats(0.01, 1.0)), min_size=1, max_size=4,
             unique_by=lambda x: x[0]))))  # old route
def test_route_invariants(cases):
    holders = {a: set(h) for a, (h, _, _) in cases.items()}
    new = {a: n for a, (_, n, _) in cases.items()}
    old = {a: o for a, (_, _, o) in cases.items()}
    catalog = set(cases) - {"f"}
    routed = migration.route(new, holders, old, catalog)
    assert set(routed) == set(new) & catalog  # every adapter with a route keeps one
    for a, entries in routed.items():
        if any(e in holders[a] for e, _ in new[a]):
            assert all(e in holders[a] for e, _ in entries)  # routes only to holders
            assert sum(p for _, p in entries) == pytest.approx(1.0)
        else:
            assert entries == old[a]
    unload = migration.to_unload(routed, holders)
    assert not any(e in dict(routed.get(a, [])) for a, e in unload)
    assert all(e in holders[a] for a, e in unload)


def test_the_real_policies_through_the_planner():
    new = migration.place(get_policy("loraserve"), CATALOG, {"a": 9e4, "c": 1e3},
                          [2, 4, 6], {}, OPS, padded=False)
    assert set(new) == set(CATALOG)
    assert {e for entries in new.values() for e, _ in entries} <= {2, 4, 6}
