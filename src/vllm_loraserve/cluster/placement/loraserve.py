"""LoRAServe adapter placement (LoRAServe §IV-A, Algorithm 1).

Given each adapter's demand (tokens/s) and per-rank operating points (the
tokens/s one server sustains within SLO at that rank), in server units
`util = demand / op[rank]`:

1. `target` = total utilisation / number of servers;
2. each rank gets round(rank utilisation / target) servers (its budget);
   ranks are served in descending order and the budgets are cut to the
   servers that exist, so a rank never gets more than its budget;
3. each rank's adapters are packed into its servers by fractional bin
   packing with capacity `target` per server: largest first, an adapter that
   does not fit is split across servers (phi = the part's share of its load);
4. leftovers, in descending rank order, go to the server with the highest
   maximum rank and the least utilisation. Leftovers are adapters with no
   demand, adapters of ranks with no budget, and what did not fit in a rank's
   servers (budgets are rounded). A leftover load fills servers that still
   have room below `target`: the highest maximum rank first, so a low-rank
   adapter does not raise a server's maximum rank, and among equal ranks the
   least utilised. Only when no server has room does it go to the least
   utilised server. An adapter with no demand goes whole to the first choice;
5. server labels are permuted to keep as much routing share as possible where
   the previous assignment had it (maximum-weight matching).

Every adapter is placed at least once and its phis sum to 1 (base.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from vllm_loraserve.cluster.placement.base import Assignment, PlacementInput
from vllm_loraserve.workloads.trace import AdapterSpec

_EPS = 1e-12


def rank_budgets(rank_util: Mapping[int, float], num_servers: int) -> dict[int, int]:
    """Step 2: servers per rank, round(util / target), highest ranks first,
    never more servers in total than exist."""
    total = sum(rank_util.values())
    if total <= _EPS:
        return dict.fromkeys(rank_util, 0)
    target = total / num_servers
    budgets, left = {}, num_servers
    for rank in sorted(rank_util, reverse=True):
        budgets[rank] = min(left, int(round(rank_util[rank] / target)))
        left -= budgets[rank]
    return budgets


def fractional_bin_packing(utils: Sequence[tuple[str, float]], servers: Sequence[int],
                           capacity: float, loads: dict[int, float],
                           parts: dict[str, dict[int, float]]) -> dict[str, float]:
    """Step 3 for one rank: fill `servers` up to `capacity` with the
    adapters' loads (largest first), splitting an adapter across servers when
    it does not fit. Records placed load in `parts` (adapter -> server ->
    load) and `loads`; returns the load that found no room, per adapter."""
    order = sorted(utils, key=lambda nu: (-nu[1], nu[0]))
    left_over, i = {}, 0
    for name, util in order:
        left = util
        while left > _EPS and i < len(servers):
            room = capacity - loads[servers[i]]
            if room <= _EPS:
                i += 1
                continue
            take = min(room, left)
            placed = parts.setdefault(name, {})
            placed[servers[i]] = placed.get(servers[i], 0.0) + take
            loads[servers[i]] += take
            left -= take
        if left > _EPS:
            left_over[name] = left
    return left_over


def allocate_leftover(name: str, rank: int, load: float, capacity: float,
                      loads: dict[int, float], max_rank: dict[int, int],
                      parts: dict[str, dict[int, float]]) -> None:
    """Step 4 for one leftover (see the module doc)."""
    def preference(s: int) -> tuple:
        return (-max_rank[s], loads[s], s)

    placed = parts.setdefault(name, {})
    if load <= _EPS:
        s = min(loads, key=preference)
        placed[s] = 0.0
        max_rank[s] = max(max_rank[s], rank)
        return
    while load > _EPS:
        roomy = [s for s in loads if capacity - loads[s] > _EPS]
        s = min(roomy, key=preference) if roomy else min(loads, key=lambda x: (loads[x], x))
        take = min(load, capacity - loads[s]) if roomy else load
        placed[s] = placed.get(s, 0.0) + take
        loads[s] += take
        max_rank[s] = max(max_rank[s], rank)
        load -= take


def _previous_overlap_labels(assignment: Assignment, previous: Assignment,
                            num_servers: int) -> dict[int, int]:
    """Step 5: the server relabelling that keeps the most routing share in place."""
    overlap = np.zeros((num_servers, num_servers))
    for name, entries in assignment.items():
        old = dict(previous.get(name, []))
        for s, phi in entries:
            for t, old_phi in old.items():
                if t < num_servers:
                    overlap[s, t] += min(phi, old_phi)
    rows, cols = linear_sum_assignment(-overlap)
    return dict(zip(rows.tolist(), cols.tolist(), strict=True))


@dataclass(frozen=True)
class Plan:
    assignment: Assignment
    budgets: dict[int, int]  # rank -> servers dedicated to it (step 2)
    dedicated: dict[int, list[int]]  # rank -> those servers (final labels)
    packed: dict[str, dict[int, float]]  # adapter -> server -> load placed in step 3


class LoRAServePlacement:
    name = "loraserve"

    def place(self, inp: PlacementInput) -> Assignment:
        return self.plan(inp).assignment

    def plan(self, inp: PlacementInput) -> Plan:
        """The placement with the intermediate decisions that tests check."""
        k = inp.num_servers
        util = {a.name: max(0.0, inp.demand.get(a.name, 0.0)) / inp.operating_points[a.rank]
                for a in inp.adapters}
        by_rank: dict[int, list[AdapterSpec]] = {}
        for a in inp.adapters:
            by_rank.setdefault(a.rank, []).append(a)
        rank_util = {r: sum(util[a.name] for a in v) for r, v in by_rank.items()}
        budgets = rank_budgets(rank_util, k)
        target = sum(rank_util.values()) / k
        loads = dict.fromkeys(range(k), 0.0)
        max_rank = dict.fromkeys(range(k), 0)
        parts: dict[str, dict[int, float]] = {}
        left_over: dict[str, float] = {}
        dedicated: dict[int, list[int]] = {}
        next_server = 0
        for rank in sorted(budgets, reverse=True):
            servers = dedicated[rank] = list(range(next_server, next_server + budgets[rank]))
            next_server += budgets[rank]
            demanded = [(a.name, util[a.name]) for a in by_rank[rank] if util[a.name] > _EPS]
            if servers and demanded:
                left_over.update(fractional_bin_packing(demanded, servers, target, loads, parts))
                for s in servers:
                    max_rank[s] = max(max_rank[s], rank)
        packed = {name: dict(p) for name, p in parts.items()}
        for a in inp.adapters:
            if a.name not in parts:
                left_over[a.name] = util[a.name]
        for a in sorted((a for a in inp.adapters if a.name in left_over),
                        key=lambda a: (-a.rank, -left_over[a.name], a.name)):
            allocate_leftover(a.name, a.rank, left_over[a.name], target, loads, max_rank, parts)
        assignment: Assignment = {}
        for a in inp.adapters:
            total = sum(parts[a.name].values())
            assignment[a.name] = [(s, p / total if total > _EPS else 1.0)
                                  for s, p in sorted(parts[a.name].items())]
        label = (_previous_overlap_labels(assignment, inp.previous, k) if inp.previous
                 else {s: s for s in range(k)})
        return Plan(
            {n: sorted((label[s], phi) for s, phi in e) for n, e in assignment.items()},
            budgets, {r: sorted(label[s] for s in v) for r, v in dedicated.items()},
            {n: {label[s]: x for s, x in p.items()} for n, p in packed.items()})
