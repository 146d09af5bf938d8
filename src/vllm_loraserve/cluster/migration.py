"""The migration planner: what one placement round decides (LoRAServe §IV),
shared by the router (cluster/router.py, which carries it out over engines)
and the simulator (sim/cluster.py, which carries it out in simulated time),
so the simulation study runs the router's own decisions.

One round:
1. `place`: the policy over the live engines, with the previous assignment
   (restricted to them) as a hint; no measured demand means a cold placement
   with equal demand for every adapter;
2. `to_ensure`: the (adapter, engine) pairs of the new placement whose
   engine does not hold the adapter: fetched and loaded before any routing
   changes;
3. `route`: once those ends are known, routing takes the new placement over
   the pairs that hold the adapter, phi renormalised; an adapter none of
   whose new pairs holds it keeps its old route;
4. `to_unload`: held pairs that routing no longer names, drained (their
   requests finish) and then unloaded, unless a later round routes them again.

Invariants (tests/cluster/test_migration.py): `route` names only holders;
every adapter of the catalogue that had a route keeps one; phi sums to 1 per
routed adapter; `to_unload` never names a routed pair.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.cluster.placement import Assignment, PlacementInput, PlacementPolicy

Pair = tuple[str, int]  # (adapter, engine)


def place(policy: PlacementPolicy, catalog: Mapping[str, int],
          demand: Mapping[str, float] | None, live: Sequence[int], previous: Assignment,
          operating_points: Mapping[int, float], padded: bool) -> Assignment:
    """The policy's placement over the engines in `live` (engine ids, not
    indices); `catalog` is adapter -> rank."""
    cold = not demand
    if cold:
        demand = dict.fromkeys(catalog, 1.0)
    index = {e: k for k, e in enumerate(live)}
    hint = {a: [(index[e], p) for e, p in entries if e in index]
            for a, entries in previous.items()}
    hint = {a: v for a, v in hint.items() if v}
    adapters = [AdapterRecord(a, r) for a, r in sorted(catalog.items())]
    placed = policy.place(PlacementInput(adapters, demand, len(live), operating_points, hint,
                                         padded=padded, cold=cold))
    return {a: [(live[k], p) for k, p in entries] for a, entries in placed.items()}


def to_ensure(new: Assignment, holders: Mapping[str, Collection[int]]) -> list[Pair]:
    """Pairs of `new` whose engine does not hold the adapter yet."""
    return [(a, e) for a, entries in new.items() for e, _ in entries
            if e not in holders.get(a, ())]


def route(new: Assignment, holders: Mapping[str, Collection[int]], old: Assignment,
          catalog: Collection[str]) -> Assignment:
    """Routing after the ensures: `new` over the pairs that hold their adapter
    (phi renormalised), else the adapter's `old` route; adapters no longer in
    `catalog` leave routing."""
    routed = {}
    for a, entries in new.items():
        if a not in catalog:
            continue
        kept = [(e, p) for e, p in entries if e in holders.get(a, ())]
        total = sum(p for _, p in kept)
        routed[a] = [(e, p / total) for e, p in kept] if kept else old.get(a, [])
    return routed


def to_unload(routed: Assignment, holders: Mapping[str, Collection[int]]) -> list[Pair]:
    """Held pairs that `routed` no longer names: drain, then unload."""
    return [(a, e) for a, engines in holders.items()
            for e in sorted(set(engines) - {e for e, _ in routed.get(a, [])})]
