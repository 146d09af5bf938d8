"""`loraserve place` (capacity planning) and `loraserve cluster up|demo`.

Nothing here imports Ray: the launcher must set Ray's loopback mode first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

from vllm_loraserve.adapters.record import read_catalog
from vllm_loraserve.cluster.launch import ADMIN_TOKEN_ENV  # imports no Ray
from vllm_loraserve.cluster.placement import POLICIES, PlacementInput, check_assignment, get_policy
from vllm_loraserve.cluster.transport import TRANSPORTS
from vllm_loraserve.perf.operating import load_profile


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
        PlacementInput(adapters, demand, a.servers, profile.operating_points, previous,
                       padded=profile.step.kind == "bgmv"))
    check_assignment(assignment, adapters, a.servers)
    print(json.dumps({k: [[s, p] for s, p in v] for k, v in sorted(assignment.items())},
                     indent=1))


def _spec(a: argparse.Namespace, **overrides):
    from vllm_loraserve.cluster.launch import ClusterSpec

    fields = dict(engines=a.engines, model=a.model, adapters=a.adapters,
                  served_model_name=a.served_model_name, policy=a.policy, host=a.host,
                  port=a.port, rebalance_s=a.rebalance_s or None,
                  health_interval_s=a.health_interval, restart_attempts=a.restart_attempts,
                  transport=a.transport, workdir=a.workdir,
                  serve_args=tuple(shlex.split(a.serve_args)), device=a.device,
                  engines_per_gpu=a.engines_per_gpu,
                  gpu_memory_utilization=a.gpu_memory_utilization,
                  engine_base_port=a.engine_base_port,
                  profile=a.profile,
                  admin_token=a.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
                  allowed_roots=tuple(os.path.abspath(r) for r in a.allowed_root or ()))
    return ClusterSpec(**{**fields, **overrides})


def _up(a: argparse.Namespace) -> None:
    from vllm_loraserve.cluster.engine_plan import PlanError
    from vllm_loraserve.cluster.launch import check_exposure, up

    spec = _spec(a)
    try:
        check_exposure(spec)  # before Ray, engines or the router open any socket
    except ValueError as e:
        raise SystemExit(f"loraserve cluster up: {e}") from None
    try:
        up(spec)  # plans the engines before it starts Ray
    except PlanError as e:
        raise SystemExit(f"loraserve cluster up: {e}") from None


def _demo(a: argparse.Namespace) -> None:
    import sys

    from vllm_loraserve.demo.cluster import run_cluster_demo

    sys.exit(run_cluster_demo(a))


def _cluster_args(p: argparse.ArgumentParser, demo: bool) -> None:
    if not demo:
        p.add_argument("--model", required=True, help="model path or name for every engine")
        p.add_argument("--adapters", required=True,
                       help="directory of PEFT adapter directories (served by name)")
        p.add_argument("--served-model-name", help="the base model's API name")
        p.add_argument("--workdir", default=".loraserve-cluster",
                       help="logs, engine stores, registered adapters (default: %(default)s)")
        p.add_argument("--serve-args", default="",
                       help='extra `vllm serve` arguments, e.g. "--max-loras 8 --dtype half"')
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--policy", choices=sorted(POLICIES), default="loraserve")
    p.add_argument("--host", default="127.0.0.1",
                   help="the router's address; a non-loopback one needs an admin token")
    p.add_argument("--admin-token", default=None,
                   help=f"bearer token the router's /admin routes require (or set "
                   f"{ADMIN_TOKEN_ENV}); required with a non-loopback --host")
    p.add_argument("--allowed-root", action="append", default=None,
                   help="directory POST /admin/adapters may read adapters from, besides "
                   "--adapters (repeatable)")
    p.add_argument("--port", type=int, default=8000 if not demo else 0,
                   help="the router's port (0 picks a free one)")
    p.add_argument("--rebalance-s", type=float, default=30.0,
                   help="seconds between placements (0: only at start and on faults)")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--restart-attempts", type=int, default=3,
                   help="restarts of a dead engine before it is left down")
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                   help="adapter transport between engines (nixl: GPU to GPU, not verified "
                   "on a GPU yet; tcp where nixl cannot start)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--profile", help="`loraserve profile` output (default: built-in model)")
    if demo:
        return
    p.add_argument("--engines-per-gpu", type=int, default=1,
                   help="CUDA: engines sharing one GPU (each gets --gpu-memory-utilization / K)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the share of each GPU its engines use together (default 0.9)")
    p.add_argument("--engine-base-port", type=int, default=0,
                   help="engine i listens on 127.0.0.1:BASE+i (default 0: free ports)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cluster", help="a Ray router over several vllm serve engines")
    csub = c.add_subparsers(dest="cluster_command", required=True)
    p = csub.add_parser("up", help="start Ray (loopback only), the engines and the router; "
                        "Ctrl-C stops everything")
    _cluster_args(p, demo=False)
    p.set_defaults(func=_up)
    p = csub.add_parser("demo", help="the embedded default on a cluster: tiny model, 25 "
                        "adapters, 2 CPU engines, requests through the router")
    _cluster_args(p, demo=True)
    p.add_argument("--workdir", default=".loraserve-cluster-demo")
    p.add_argument("--num-adapters", type=int, default=25)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(func=_demo)

    p = sub.add_parser("place", help="print an adapter placement (JSON) for capacity planning")
    p.add_argument("--policy", choices=sorted(POLICIES), default="loraserve")
    p.add_argument("--adapters", required=True, help='JSON list of {"name", "rank"}')
    p.add_argument("--demand", required=True, help="JSON: adapter name -> tokens/s")
    p.add_argument("--servers", type=int, required=True)
    p.add_argument("--profile", help="profile JSON (default: the documented default model)")
    p.add_argument("--previous", help="an earlier output of this command")
    p.add_argument("--seed", type=int, default=0, help="random policy's seed")
    p.set_defaults(func=_place)
