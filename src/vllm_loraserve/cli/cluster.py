"""`loraserve place` (capacity planning) and `loraserve cluster ...`."""

from __future__ import annotations

import argparse
import json

from vllm_loraserve.cluster.placement import POLICIES, PlacementInput, check_assignment, get_policy
from vllm_loraserve.perf.model import Profile, default_profile
from vllm_loraserve.perf.operating import with_operating_points
from vllm_loraserve.workloads.trace import read_catalog


def load_profile(path: str | None, ranks) -> Profile:
    """A profile with operating points for `ranks` (computed if missing)."""
    profile = Profile.load(path) if path else default_profile()
    return with_operating_points(profile, ranks)


def _place(a: argparse.Namespace) -> None:
    adapters = read_catalog(a.adapters)
    with open(a.demand) as f:
        demand = {str(k): float(v) for k, v in json.load(f).items()}
    unknown = sorted(set(demand) - {x.name for x in adapters})
    if unknown:
        raise SystemExit(f"demand names adapters not in {a.adapters}: {unknown[:5]}")
    previous = None
    if a.previous:
        with open(a.previous) as f:
            previous = {k: [(int(s), float(p)) for s, p in v] for k, v in json.load(f).items()}
    profile = load_profile(a.profile, {x.rank for x in adapters})
    assignment = get_policy(a.policy, a.seed).place(
        PlacementInput(adapters, demand, a.servers, profile.operating_points, previous))
    check_assignment(assignment, adapters, a.servers)
    print(json.dumps({k: [[s, p] for s, p in v] for k, v in sorted(assignment.items())},
                     indent=1))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("place", help="print an adapter placement (JSON) for capacity planning")
    p.add_argument("--policy", choices=sorted(POLICIES), default="loraserve")
    p.add_argument("--adapters", required=True, help='JSON list of {"name", "rank"}')
    p.add_argument("--demand", required=True, help="JSON: adapter name -> tokens/s")
    p.add_argument("--servers", type=int, required=True)
    p.add_argument("--profile", help="profile JSON (default: the documented default model)")
    p.add_argument("--previous", help="an earlier output of this command")
    p.add_argument("--seed", type=int, default=0, help="random policy's seed")
    p.set_defaults(func=_place)
