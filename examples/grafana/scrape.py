#!/usr/bin/env python3
"""Record real /metrics scrapes of a running cluster for render.py: the demo's
tiny model and adapters on 2 CPU engines (`vllm serve --plugin loraserve`)
behind the router (`loraserve cluster`, placing every 20 s), traffic through
the router whose hot adapters change half-way (so the router migrates), and
every engine's and the router's /metrics read every 10 s.

Only the `loraserve_*` families are kept (the dashboard queries nothing else;
vLLM's own families would make the file a hundred times larger).

    python examples/grafana/scrape.py --out docs/dashboard-scrapes.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

import httpx

from vllm_loraserve.cluster.launch import Cluster, ClusterSpec
from vllm_loraserve.demo.assets import build_assets
from vllm_loraserve.demo.cluster import SERVE_ARGS
from vllm_loraserve.demo.run import BASE_NAME
from vllm_loraserve.process import free_port


def _keep(line: str) -> bool:
    name = line.removeprefix("# HELP ").removeprefix("# TYPE ")
    return name.startswith("loraserve_") and "_created" not in name.split(" ")[0]


async def _scrape(client: httpx.AsyncClient, targets: dict[str, tuple[str, str]],
                  t0: float) -> list[dict]:
    out = []
    for instance, (job, url) in targets.items():
        text = (await client.get(f"{url}/metrics", timeout=60)).text
        out.append({"t": round(time.time() - t0, 3), "job": job, "instance": instance,
                    "text": "\n".join(x for x in text.splitlines() if _keep(x)) + "\n"})
    return out


async def _traffic(url: str, adapters: list[str], stop: asyncio.Event, half: float,
                   t0: float) -> int:
    """Requests from 4 clients; the first half of the run favours the first
    half of the adapters 9:1, the second half the others."""
    rng = random.Random(0)
    first, second = adapters[: len(adapters) // 2], adapters[len(adapters) // 2:]
    sent = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal sent
        while not stop.is_set():
            hot, cold = (first, second) if time.time() - t0 < half else (second, first)
            model = rng.choice(hot if rng.random() < 0.9 else cold)
            r = await c.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": 8})
            r.raise_for_status()
            sent += 1

    async with httpx.AsyncClient() as c:
        await asyncio.gather(*(client(c) for _ in range(4)))
    return sent


async def _record(url: str, engines: dict[str, str], adapters: list[str], duration: float,
                  every: float) -> list[dict]:
    targets = {"router": ("router", url), **{f"engine-{i}": ("engine", u)
                                             for i, u in engines.items()}}
    stop, t0, scrapes = asyncio.Event(), time.time(), []
    traffic = asyncio.create_task(_traffic(url, adapters, stop, duration / 2, t0))
    async with httpx.AsyncClient() as client:
        while time.time() - t0 < duration:
            scrapes += await _scrape(client, targets, t0)
            await asyncio.sleep(every)
        stop.set()
        print(f"{await traffic} requests sent")
        scrapes += await _scrape(client, targets, t0)
    return scrapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/dashboard-scrapes.json")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of traffic")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between scrapes")
    ap.add_argument("--num-adapters", type=int, default=12)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="loraserve-dashboard-") as work:
        assets = os.path.join(work, "assets")
        build_assets(assets, num_adapters=a.num_adapters)
        spec = ClusterSpec(engines=2, model=os.path.join(assets, "model"),
                           adapters=os.path.join(assets, "adapters"),
                           served_model_name=BASE_NAME, port=free_port(), rebalance_s=20.0,
                           workdir=os.path.join(work, "cluster"), serve_args=SERVE_ARGS,
                           device="cpu")
        cluster = Cluster(spec)
        try:
            url = cluster.start()
            status = httpx.get(f"{url}/admin/status", timeout=30).json()
            engines = {i: e["url"] for i, e in status["engines"].items()}
            adapters = sorted(status["placement"])
            scrapes = asyncio.run(_record(url, engines, adapters, a.duration, a.every))
        finally:
            cluster.stop()
    with open(a.out, "w") as f:
        json.dump({"what": f"2 CPU engines + router, {a.num_adapters} demo adapters",
                   "date": time.strftime("%Y-%m-%d"), "scrapes": scrapes}, f, indent=0)
    print(f"wrote {len(scrapes)} scrapes to {a.out}")


if __name__ == "__main__":
    main()
