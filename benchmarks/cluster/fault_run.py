"""Issue 25's fault scenario against a live router: kill one engine during a
trace, and time each phase until it has rejoined.

    python benchmarks/cluster/fault_run.py --router http://127.0.0.1:8000 \\
        --engine 0 --kill-after-s 20 --out benchmarks/cluster/results/fault-h200.json

Run it on the router's machine (it kills the engine's `vllm serve` by the PID
and process group that `GET /admin/status` lists). Clients send closed-loop
requests over every adapter (a share streamed) from the start to the end;
the engine is killed after `--kill-after-s`; the router's state is polled
until the engine is back in routing and holds adapters again (the router
restarts it: start the cluster with restart attempts > 0, the default).

Recorded (printed, and written as JSON with the command, date and machine):
- the router's own phase timings (`GET /admin/faults`: detection,
  re-placement, first request served elsewhere, rejoin);
- the same phases as the client saw them, from the kill: out of routing,
  every adapter it held on a live engine, first request for one of them
  answered 200, back in routing, holding adapters again;
- every request's outcome around the kill: ok, retried (the router says so
  in its metrics), 503 (with the router's message), a stream ended by an
  error event, any other status, a client timeout (a hang);
- lost adapters (served before the kill, not after the rejoin) and
  duplicated streamed output (content after a stream's error event).
Exits 1 if an adapter was lost, output was duplicated, a request hung or
answered something other than 200/503/a clean stream error, or the engine
did not rejoin.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import sys
import time
from collections import Counter

import httpx


def _choices_text(event: dict) -> list[str]:
    return [c.get("text") or (c.get("delta") or {}).get("content") or ""
            for c in event.get("choices", [])]


async def _one(client: httpx.AsyncClient, model: str, stream: bool, max_tokens: int,
               t0: float) -> dict:
    """One request's outcome: status, engine, and for a stream whether an
    error event ended it and whether content followed that event."""
    rec = {"model": model, "stream": stream, "start_s": time.monotonic() - t0}
    body = {"model": model, "prompt": "Tell me about faults.", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec["status"], rec["engine"] = r.status_code, r.headers.get("x-loraserve-engine")
            if r.status_code != 200 or not stream:
                raw = await r.aread()
                if r.status_code != 200:
                    try:
                        rec["error"] = json.loads(raw)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        rec["error"] = raw.decode(errors="replace")[:300]
            else:
                after_error = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["stream_error"] = event["error"]["message"]
                    elif "stream_error" in rec and any(_choices_text(event)):
                        after_error += 1
                rec["content_after_error"] = after_error
    except httpx.TimeoutException as e:
        rec["status"], rec["error"] = "timeout", f"{type(e).__name__}"
    except httpx.HTTPError as e:
        rec["status"], rec["error"] = "transport", f"{type(e).__name__}: {e}"
    rec["end_s"] = time.monotonic() - t0
    return rec


async def _clients(url: str, adapters: list[str], a, stop: asyncio.Event, t0: float,
                   records: list) -> None:
    rng = random.Random(a.seed)
    async with httpx.AsyncClient(base_url=url, timeout=a.request_timeout_s) as client:
        async def worker():
            while not stop.is_set():
                records.append(await _one(client, rng.choice(adapters),
                                          rng.random() < a.stream_fraction, a.max_tokens, t0))
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))


def _kill(pid: int) -> str:
    """SIGKILL the engine's server and its process group (its own session)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return "process group"
    except ProcessLookupError:
        pass
    os.kill(pid, signal.SIGKILL)
    return "process"


async def run(a) -> dict:
    headers = {"authorization": f"Bearer {a.admin_token}"} if a.admin_token else {}
    admin = httpx.AsyncClient(base_url=a.router, headers=headers, timeout=30)
    status = (await admin.get("/admin/status")).raise_for_status().json()
    victim = str(a.engine)
    adapters = sorted(x["name"] for x in (await admin.get("/admin/adapters")).json()["adapters"])
    served_before = {x["id"] for x in (await admin.get("/v1/models")).json()["data"]}
    faults_before = len((await admin.get("/admin/faults")).json()["faults"])
    t0 = time.monotonic()
    records: list = []
    stop = asyncio.Event()
    load = asyncio.create_task(_clients(a.router, adapters, a, stop, t0, records))
    await asyncio.sleep(a.kill_after_s)

    status = (await admin.get("/admin/status")).json()
    engine = status["engines"][victim]
    held = set(engine["adapters"])
    t_kill = time.monotonic() - t0
    how = _kill(engine["pid"])
    print(f"killed engine {victim} (pid {engine['pid']}, its {how}) at {t_kill:.2f}s, "
          f"holding {len(held)} adapters", flush=True)
    seen: dict[str, float] = {}
    deadline = time.monotonic() + a.rejoin_timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic() - t0 - t_kill
        s = (await admin.get("/admin/status")).json()
        alive = set(map(str, s["alive"]))
        live_holders = {x["name"]: set(map(str, x["holders"])) & alive
                        for x in (await admin.get("/admin/adapters")).json()["adapters"]}
        if victim not in alive:
            seen.setdefault("out_of_routing_s", now)
            if all(live_holders.get(x) for x in held):
                seen.setdefault("replaced_s", now)
        elif "out_of_routing_s" in seen:
            seen.setdefault("back_in_routing_s", now)
            if s["engines"][victim]["adapters"]:
                seen.setdefault("holds_adapters_again_s", now)
                break
        await asyncio.sleep(a.poll_s)
    await asyncio.sleep(a.after_rejoin_s)  # requests served with the engine back
    stop.set()
    await load
    first_ok = min((r["end_s"] - t_kill for r in records if r["model"] in held
                    and r["status"] == 200 and not r.get("stream_error")
                    and r["engine"] != victim and r["end_s"] > t_kill), default=None)
    seen["first_ok_elsewhere_s"] = first_ok
    faults = (await admin.get("/admin/faults")).json()["faults"][faults_before:]
    metrics = (await admin.get("/metrics")).text
    served_after = {x["id"] for x in (await admin.get("/v1/models")).json()["data"]}
    final = {x["name"]: x["holders"] for x in (await admin.get("/admin/adapters")).json()
             ["adapters"]}
    await admin.aclose()

    def kind(r: dict) -> str:
        if r["status"] == 200:
            return "stream_error" if r.get("stream_error") else "ok"
        return str(r["status"])
    around = [r for r in records if r["end_s"] >= t_kill - 1]
    outcomes = Counter(kind(r) for r in records)
    lost = sorted((served_before - served_after)
                  | {x for x in adapters if x in served_after and not final.get(x)})
    duplicated = sum(r.get("content_after_error", 0) for r in records)
    retries = [line for line in metrics.splitlines()
               if line.startswith("loraserve_router_retries_total")]
    return {
        "engine": a.engine, "kill_at_s": t_kill, "held": sorted(held),
        "router_faults": faults, "client_phases_s": seen,
        "requests": len(records), "outcomes": dict(outcomes),
        "outcomes_around_kill": dict(Counter(kind(r) for r in around)),
        "errors": sorted({r.get("error") or r.get("stream_error") for r in records
                          if kind(r) != "ok"} - {None})[:20],
        "router_retries": retries, "lost_adapters": lost,
        "content_after_stream_error": duplicated,
        "rejoined": "holds_adapters_again_s" in seen,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="http://127.0.0.1:8000")
    p.add_argument("--admin-token", default=os.environ.get("LORASERVE_ADMIN_TOKEN"))
    p.add_argument("--engine", type=int, default=0, help="the engine to kill")
    p.add_argument("--kill-after-s", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request longer than this counts as a hang")
    p.add_argument("--rejoin-timeout-s", type=float, default=900.0)
    p.add_argument("--after-rejoin-s", type=float, default=10.0)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result = asyncio.run(run(a))
    print(json.dumps(result, indent=1))
    bad = set(result["outcomes"]) - {"ok", "503", "stream_error"}
    passed = (not result["lost_adapters"] and not result["content_after_stream_error"]
              and not bad and result["rejoined"])
    print(f"{'PASSED' if passed else 'FAILED'}: {result['requests']} requests, outcomes "
          f"{result['outcomes']}, lost {result['lost_adapters']}, rejoined "
          f"{result['rejoined']}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "started_utc": started,
                       "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                       **result, "passed": passed}, f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
