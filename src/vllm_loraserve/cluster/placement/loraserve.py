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
   servers (budgets are rounded). A leftover never raises the maximum rank of
   a server that holds adapters while a server covers it (maximum rank at
   least its rank, or empty): its load fills covering servers that still have
   room below `target` (highest maximum rank first, then least utilised), and
   only when none has room does the rest go to the least utilised covering
   server, above `target`. (Spilling a rank-128 overflow onto a rank-32
   server instead pads that server's whole batch to rank 128 under
   BGMV-style kernels: docs/benchmarks/README.md.) A rank above every busy
   server's maximum rank, with no empty server, may go to any server with
   room. With padded kernels (`PlacementInput.padded`), the load a leftover
   adds to a server is costed at that server's maximum rank (its tokens run
   padded to it), not at the adapter's own rank as in the paper. An adapter
   with no demand goes whole to the covering server holding the fewest
   adapters;
   With `PlacementInput.cold` (no demand measured yet, e.g. a router that
   just started), step 3 spreads each adapter evenly over its rank's servers
   instead of packing a guessed demand. Ties between equal loads are broken
   by a hash of the name, not by the name;
5. server labels are permuted to keep as much routing share as possible where
   the previous assignment had it (maximum-weight matching).

Every adapter is placed at least once and its phis sum to 1 (base.py).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.cluster.placement.base import Assignment, PlacementInput

_EPS = 1e-12


def _tiebreak(name: str) -> tuple[int, str]:
    """Order among equal loads that does not follow the names (generated
    names often follow popularity), yet is deterministic."""
    return zlib.crc32(name.encode()), name


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
    order = sorted(utils, key=lambda nu: (-nu[1], _tiebreak(nu[0])))
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
                      parts: dict[str, dict[int, float]], held: Counter[int],
                      padded_ops: Mapping[int, float] | None = None) -> None:
    """Step 4 for one leftover (see the module doc). `load` and `parts` are
    in units of the adapter's own operating point; with `padded_ops` (padded
    kernels) the load it adds to server s is costed at s's maximum rank.
    `held` counts adapters per server."""
    def preference(s: int) -> tuple:
        return (-max_rank[s], loads[s], s)

    def cost(s: int) -> float:  # server load per unit of this adapter's load
        if padded_ops is None:
            return 1.0
        return padded_ops[rank] / padded_ops[max(rank, max_rank[s])]

    placed = parts.setdefault(name, {})
    # Servers whose maximum rank already covers this adapter, and empty ones;
    # only when there are none may a busy server's maximum rank rise (padded
    # kernels would then slow every request on it, not just this adapter's).
    covering = [s for s in loads if max_rank[s] >= rank or max_rank[s] == 0] or list(loads)
    if load <= _EPS:  # no demand: whole, where the fewest adapters are (memory)
        s = min(covering, key=lambda x: (held[x], *preference(x)))
        placed[s] = 0.0
        held[s] += 1
        max_rank[s] = max(max_rank[s], rank)
        return
    while load > _EPS:
        roomy = [s for s in covering if capacity - loads[s] > _EPS]
        s = min(roomy, key=preference) if roomy else min(covering, key=lambda x: (loads[x], x))
        c = cost(s)
        take = min(load, (capacity - loads[s]) / c) if roomy else load
        held[s] += s not in placed
        placed[s] = placed.get(s, 0.0) + take
        loads[s] += take * c
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
        by_rank: dict[int, list[AdapterRecord]] = {}
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
            if not (servers and demanded):
                continue
            if inp.cold:
                for name, u in demanded:  # no measured demand to pack: spread
                    parts[name] = {s: u / len(servers) for s in servers}
                    for s in servers:
                        loads[s] += u / len(servers)
            else:
                left_over.update(fractional_bin_packing(demanded, servers, target, loads, parts))
            for s in servers:
                max_rank[s] = max(max_rank[s], rank)
        packed = {name: dict(p) for name, p in parts.items()}
        for a in inp.adapters:
            if a.name not in parts:
                left_over[a.name] = util[a.name]
        held = Counter(s for p in parts.values() for s in p)
        for a in sorted((a for a in inp.adapters if a.name in left_over),
                        key=lambda a: (-a.rank, -left_over[a.name], _tiebreak(a.name))):
            allocate_leftover(a.name, a.rank, left_over[a.name], target, loads, max_rank, parts,
                              held, inp.operating_points if inp.padded else None)
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
