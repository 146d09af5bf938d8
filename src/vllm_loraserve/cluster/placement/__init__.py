"""Placement policies by name (shared by the router and the simulator)."""

from __future__ import annotations

from vllm_loraserve.cluster.placement.base import (
    Assignment,
    PlacementInput,
    PlacementPolicy,
    check_assignment,
    churn,
    server_loads,
)
from vllm_loraserve.cluster.placement.baselines import (
    ContiguousPlacement,
    RandomPlacement,
    ReplicateAllPlacement,
)
from vllm_loraserve.cluster.placement.loraserve import LoRAServePlacement

POLICIES = {
    "random": RandomPlacement,
    "contiguous": ContiguousPlacement,
    "loraserve": LoRAServePlacement,
    "toppings": ReplicateAllPlacement,  # placement part; requests are routed by cost score
}


def get_policy(name: str, seed: int = 0) -> PlacementPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown placement policy {name!r}; choose from {sorted(POLICIES)}")
    return RandomPlacement(seed) if name == "random" else POLICIES[name]()


__all__ = ["POLICIES", "Assignment", "PlacementInput", "PlacementPolicy", "check_assignment",
           "churn", "get_policy", "server_loads"]
