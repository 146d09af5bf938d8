"""The routing table: per adapter, the engines that serve it and their phi.

A request for an adapter goes to engine e with probability phi(e) (LoRAServe
§IV): one uniform draw against the cumulative phi. Excluded engines (dead,
or one a request just failed on) are skipped and the others' phi renormalised.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection

from vllm_loraserve.cluster.placement import Assignment


class RoutingTable:
    def __init__(self, assignment: Assignment) -> None:
        self.assignment = {a: list(e) for a, e in assignment.items()}
        self._engines = {a: [s for s, _ in e] for a, e in assignment.items()}
        self._cum = {a: list(itertools.accumulate(p for _, p in e))
                     for a, e in assignment.items()}

    def engines(self, adapter: str) -> list[int]:
        return self._engines.get(adapter, [])

    def pick(self, adapter: str, u: float, exclude: Collection[int] = ()) -> int | None:
        """The engine for a uniform draw `u` in [0, 1), or None if none is left."""
        if not exclude:
            cum = self._cum[adapter]
            i = bisect.bisect_right(cum, u * cum[-1])
            return self._engines[adapter][min(i, len(cum) - 1)]
        left = [(s, p) for s, p in self.assignment.get(adapter, []) if s not in exclude]
        if not left:
            return None
        target, acc = u * sum(p for _, p in left), 0.0
        for s, p in left:
            acc += p
            if target < acc:
                return s
        return left[-1][0]
