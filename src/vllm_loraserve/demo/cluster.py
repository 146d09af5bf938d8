"""`loraserve cluster demo`: the embedded default behind the cluster router.

Builds the tiny model and adapters, starts Ray on loopback, two CPU engines
(`vllm serve --plugin loraserve`, one core each) and the router, sends
requests for every adapter through the router, prints what came back and
where the placement put each adapter, and stops everything.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vllm_loraserve.demo.assets import DEMO_RANKS, build_assets
from vllm_loraserve.demo.run import BASE_NAME, print_table, send_requests
from vllm_loraserve.process import free_port

SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--max-loras", "8",
              "--max-num-seqs", "32")


def requests_by_engine(router_url: str) -> Counter[str]:
    text = httpx.get(f"{router_url}/metrics", timeout=30).text
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "loraserve_router_requests_total" and s.labels["status"] == "ok":
                out[s.labels["engine"]] += int(s.value)
    return out


def print_placement(status: dict[str, Any], ranks: dict[str, int],
                    served: Counter[str]) -> None:
    print(f"\n{'engine':<7} {'pid':>7} {'alive':<6} {'adapters':>8} {'requests':>8}  ranks held")
    for e, info in sorted(status["engines"].items(), key=lambda kv: int(kv[0])):
        held = Counter(ranks[a] for a in info["adapters"] if a in ranks)
        mix = ", ".join(f"r{r}x{n}" for r, n in sorted(held.items()))
        print(f"{e:<7} {info['pid'] or '-':>7} {str(info['alive']):<6} "
              f"{len(info['adapters']):>8} {served[str(e)]:>8}  {mix}")
    split = [a for a, v in status["placement"].items() if len(v) > 1]
    print(f"adapters split over several engines: {split or 'none'}")


def run_cluster_demo(a: Any) -> int:
    from vllm_loraserve.cluster.launch import Cluster, ClusterSpec

    workdir = os.path.abspath(a.workdir)
    assets = os.path.join(workdir, "assets")
    print(f"building the tiny model and {a.num_adapters} adapters in {assets} ...")
    build_assets(assets, num_adapters=a.num_adapters)
    spec = ClusterSpec(
        engines=a.engines, model=os.path.join(assets, "model"),
        adapters=os.path.join(assets, "adapters"), served_model_name=BASE_NAME,
        policy=a.policy, host=a.host, port=a.port or free_port(),
        rebalance_s=a.rebalance_s or None, health_interval_s=a.health_interval,
        restart_attempts=a.restart_attempts, transport=a.transport,
        workdir=os.path.join(workdir, "cluster"), serve_args=SERVE_ARGS, device="cpu",
        profile=a.profile)
    cluster = Cluster(spec)
    print(f"starting Ray, {spec.engines} engines and the router "
          f"(engine logs in {spec.workdir}/engine-*/server.log) ...")
    try:
        url = cluster.start()
        print(f"router: {url}")
        listing = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        adapters = [{"name": m["id"], "rank": m["rank"]} for m in listing if "rank" in m]
        t0 = time.perf_counter()
        results = asyncio.run(send_requests(url, BASE_NAME, adapters, a.requests,
                                            a.concurrency, a.max_tokens))
        wall = time.perf_counter() - t0
        print_table(results)
        served = requests_by_engine(url)
        print_placement(httpx.get(f"{url}/admin/status", timeout=30).json(),
                        {x["name"]: x["rank"] for x in adapters}, served)
    finally:
        print("stopping the router, the engines and Ray ...")
        cluster.stop()

    ok = [r for r in results if r.error is None]
    names = {r.model for r in ok if r.rank is not None}
    ranks = sorted({r.rank for r in ok if r.rank is not None})
    print(f"\n{len(ok)}/{len(results)} requests answered in {wall:.1f}s by "
          f"{sum(1 for n in served.values() if n)} engines; {len(names)} adapters of ranks "
          f"{ranks}")
    want = min(20, len(adapters))
    if (len(ok) != len(results) or len(names) < want or ranks != sorted(DEMO_RANKS)
            or sum(1 for n in served.values() if n) < min(2, spec.engines)):
        print(f"cluster demo FAILED: expected every request answered, >= {want} adapters of "
              f"ranks {sorted(DEMO_RANKS)}, and every engine serving")
        return 1
    return 0
