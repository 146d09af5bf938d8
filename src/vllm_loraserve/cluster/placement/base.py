"""Placement: which engines hold each adapter, and with what routing share.

A placement policy is a pure function of (adapters with rank and demand,
number of servers, per-rank operating points, previous assignment) to an
`Assignment`: adapter name -> [(server index, phi)], where phi is the share
of the adapter's requests routed to that server.

Invariants (checked by `check_assignment`, asserted in tests):
- every adapter is placed on at least one server;
- every phi is in (0, 1] and an adapter's phis sum to 1;
- server indices are in range and unique per adapter.
The same inputs give the same output (policies that draw at random take a
seed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_loraserve.adapters.record import AdapterRecord

Assignment = dict[str, list[tuple[int, float]]]


@dataclass(frozen=True)
class PlacementInput:
    adapters: Sequence[AdapterRecord]
    demand: Mapping[str, float]  # tokens/s (prompt + output) per adapter; missing = 0
    num_servers: int
    operating_points: Mapping[int, float]  # rank -> tokens/s one server sustains in SLO
    previous: Assignment | None = None
    # The engines' LoRA kernels pad a batch to its largest rank (BGMV-style,
    # `StepModel.kind == "bgmv"`): a token costs at its server's maximum rank.
    padded: bool = False
    # Nothing measured yet: `demand` is a uniform guess. loraserve then spreads
    # each adapter over its rank's servers instead of packing the guess (which
    # would put whatever sorts first, e.g. the hottest adapters, on one server).
    cold: bool = False


class PlacementPolicy(Protocol):
    name: str

    def place(self, inp: PlacementInput) -> Assignment: ...


def check_assignment(assignment: Assignment, adapters: Sequence[AdapterRecord],
                     num_servers: int, tol: float = 1e-9) -> None:
    """Raise ValueError naming the first broken invariant."""
    names = {a.name for a in adapters}
    if set(assignment) != names:
        missing, extra = sorted(names - set(assignment)), sorted(set(assignment) - names)
        raise ValueError(f"assignment misses {missing[:5]} / has unknown {extra[:5]}")
    for name, entries in assignment.items():
        if not entries:
            raise ValueError(f"adapter {name} is on no server")
        servers = [s for s, _ in entries]
        if len(set(servers)) != len(servers) or not all(0 <= s < num_servers for s in servers):
            raise ValueError(f"adapter {name}: bad server list {servers}")
        if not all(0 < phi <= 1 + tol for _, phi in entries):
            raise ValueError(f"adapter {name}: phi outside (0, 1]: {entries}")
        if abs(sum(phi for _, phi in entries) - 1) > 1e-6:
            raise ValueError(f"adapter {name}: phi sums to {sum(p for _, p in entries)}")


def server_loads(assignment: Assignment, adapters: Sequence[AdapterRecord],
                 demand: Mapping[str, float], operating_points: Mapping[int, float]
                 ) -> list[float]:
    """Each server's utilisation: sum of phi * demand / operating point."""
    rank = {a.name: a.rank for a in adapters}
    n = 1 + max((s for entries in assignment.values() for s, _ in entries), default=-1)
    loads = [0.0] * n
    for name, entries in assignment.items():
        u = demand.get(name, 0.0) / operating_points[rank[name]]
        for s, phi in entries:
            loads[s] += phi * u
    return loads


def churn(new: Assignment, old: Assignment) -> float:
    """Fraction of routing share that moved: half the L1 distance of the phi
    vectors, averaged over adapters (0: identical, 1: all moved)."""
    moved = 0.0
    for name, entries in new.items():
        a, b = dict(entries), dict(old.get(name, []))
        moved += 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))
    return moved / max(1, len(new))
