"""Baseline placements from the LoRAServe evaluation (§V-D).

- `random` (S-LoRA Random): each adapter on one server drawn at random.
- `contiguous` (S-LoRA Contiguous): adapters sorted by rank, equal counts per
  server, contiguously, so close ranks share a server.
- `toppings`: every adapter on every server with equal shares; Toppings
  routes each request by a cost score instead (placement/toppings.py), so
  the shares are only the fallback.
All three ignore demand.
"""

from __future__ import annotations

import numpy as np

from vllm_loraserve.cluster.placement.base import Assignment, PlacementInput


class RandomPlacement:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def place(self, inp: PlacementInput) -> Assignment:
        rng = np.random.default_rng(self.seed)
        servers = rng.integers(0, inp.num_servers, len(inp.adapters))
        return {a.name: [(int(s), 1.0)] for a, s in zip(inp.adapters, servers, strict=True)}


class ContiguousPlacement:
    name = "contiguous"

    def place(self, inp: PlacementInput) -> Assignment:
        ordered = sorted(inp.adapters, key=lambda a: (a.rank, a.name))
        n, k = len(ordered), inp.num_servers
        # server s gets adapters [floor(s*n/k), floor((s+1)*n/k))
        return {a.name: [(i * k // n, 1.0)] for i, a in enumerate(ordered)}


class ReplicateAllPlacement:
    name = "toppings"

    def place(self, inp: PlacementInput) -> Assignment:
        k = inp.num_servers
        return {a.name: [(s, 1.0 / k) for s in range(k)] for a in inp.adapters}
