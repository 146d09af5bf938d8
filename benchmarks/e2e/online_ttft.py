#!/usr/bin/env python3
"""Online latency: `loraserve bench replay` against `vllm serve`, one server
per config, at a fixed request rate (open loop, Poisson arrivals).

The model, adapters and engine settings are bench_e2e.py's (Llama-2-7B
shape, dummy bf16 weights, PEFT adapters of ranks 8..128 on q,k,v,o, 100
distinct weight sets hard-linked under many names). Each config replays the
same trace shape, made by `loraserve bench gen --kind loraserve` over its
number of adapters (prompt and output lengths U[8,512]); trace adapter
"r{rank}-{j}" is served as the j-th served adapter of that rank. `none`
and pool-base-only replay the 100-adapter trace with every request sent to
the base model (pool-base-only: on a server with the plugin and the 100
adapters); pool-r8-single replays a one-adapter trace (adapter a0000, rank 8).

`--cold-start MODE` starts the plugin configs with `--loraserve-cold-start
MODE` (issue 24); without it they get the server's default. `--pool-flags`
adds any other plugin flags to them, e.g. `--pool-flags="--loraserve-read-pause off"`.

`--start-in host` starts the adapters in host memory instead of on disk
(issue 24): before the replay, the adapters of the trace's first requests
are prefetched (`POST /loraserve/v1/adapters/{name}/prefetch`) into the host
tier, four at a time in the order of their first request, until it is full
(`--host-cache-bytes` sets the plugin configs' tier budget). How many made
it is in the config's result (`prefetched`).

    python3 benchmarks/e2e/online_ttft.py --configs none,pool-100 --rate 12 --duration 60 --out $OUT

Results: replay-CONFIG.json (every request, and the summary: TTFT, TPOT,
E2E percentiles) and online.json with the summaries and, for configs that
send requests to adapters, TTFT split into each adapter's first request and
the later ones (bench/replay.py `first_and_later`: n, percentiles). For
plugin configs, `replay_metrics` holds what the pool's counters and
histograms on /metrics grew by during the replay (`POOL_METRICS`: reads into
the host tier and page loads, `loraserve_adapter_load_seconds` by tier;
requests' waits for their adapter's read, `loraserve_adapter_wait_seconds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402  (assets shared with the offline benchmark)

from vllm_loraserve.bench import replay  # noqa: E402
from vllm_loraserve.config import LoraServeConfig  # noqa: E402
from vllm_loraserve.process import Server, free_port, vllm_executable  # noqa: E402

BASE = "base"
# The batch limits are the offline LLM's defaults on an H200 (`vllm serve`
# defaults to 8192 batched tokens): both then make one vLLM compile-cache key,
# so on one machine the servers reuse bench_e2e.py's compiles.
COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048",
          "--gpu-memory-utilization", "0.9", "--seed", "0", "--served-model-name", BASE,
          "--max-num-batched-tokens", "16384", "--max-num-seqs", "1024"]
LORA = ["--enable-lora", "--max-lora-rank", "128", "--lora-target-modules",
        *bench_e2e.TARGETS["qkvo"][1]]
# The modes a run compares; 'auto' only picks one of them per device (the
# server's default, run by passing no --cold-start).
COLD_STARTS = tuple(c for c in next(f.metadata["choices"] for f in dataclasses.fields(
    LoraServeConfig) if f.name == "cold_start") if c != "auto")
# name -> (adapters in the trace, plugin on, requests sent to adapters);
# pool-base-only serves 100 adapters and sends every request to the base model
CONFIGS = {"none": (100, False, False), "stock-100": (100, False, True),
           "pool-100": (100, True, True), "pool-1000": (1000, True, True),
           "pool-2000": (2000, True, True), "pool-r8-single": (1, True, True),
           "pool-base-only": (100, True, False)}


def loraserve_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "vllm_loraserve.cli.main", *args], check=True)


def pool_args(root: str, n: int, cold_start: str | None = None,
              host_bytes: int | None = None) -> list[str]:
    """A plugin server's flags, serving the first n names of root/names
    (bench_e2e.write_adapters) from the directory root/served-N; `cold_start`:
    its --loraserve-cold-start, or None for the server's default;
    `host_bytes`: its host tier's budget, or None for the default."""
    served = os.path.join(root, f"served-{n}")  # just these names
    os.makedirs(served, exist_ok=True)
    for i in range(n):
        link = os.path.join(served, f"a{i:04d}")
        if not os.path.lexists(link):
            os.symlink(os.path.join(root, "names", f"a{i:04d}"), link)
    # The served names are symlinks into root/names: a root adapters may resolve into.
    return [*LORA, "--max-loras", "1", "--plugin", "loraserve", "--loraserve-adapter-dir",
            served, "--loraserve-allowed-root", root,
            *(["--loraserve-cold-start", cold_start] if cold_start else []),
            *(["--loraserve-host-cache-bytes", str(host_bytes)] if host_bytes else [])]


POOL_METRICS = ("loraserve_adapter_load_seconds", "loraserve_adapter_wait_seconds",
                "loraserve_pool_page_events", "loraserve_pool_prefetch",
                "loraserve_pool_layer_groups")


def pool_metrics(text: str) -> dict[str, float]:
    """The samples of `POOL_METRICS` families in a /metrics page, keyed
    `name{label=value,...}`."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in POOL_METRICS:
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def scrape(url: str) -> dict[str, float] | str:
    """`pool_metrics` of the server's /metrics, or why not: the replay's
    results do not depend on it."""
    try:
        return pool_metrics(httpx.get(f"{url}/metrics", timeout=30).raise_for_status().text)
    except Exception as e:  # noqa: BLE001  (recorded in the config's result)
        return f"{type(e).__name__}: {e}"


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter sample grew by (`pool_metrics` of two scrapes)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items()}


def prefetch(client: httpx.Client, trace: str, mapping: dict[str, str], window: int = 4,
             limit_s: float = 120, poll_s: float = 0.01) -> dict:
    """Fill the host tier (`client`: the server's base URL) with the adapters
    of the trace's first requests, in the order of their first request,
    `window` at a time (the server's default reader threads), each asked
    again every `poll_s` while its read is under way (202), until the tier
    answers 409: then no new one is asked, and those under way are asked
    until they end. An idle server's tier keeps every adapter read since its
    last step (the prefetch route), so nothing read here is evicted here.
    (One at a time with a 0.2 s poll, 196 adapters took 41 s on an H200
    host, where a read takes about 20 ms.) Counts of what happened, and how
    many are in the host tier at the end."""
    order: list[str] = []
    with open(trace) as f:
        for line in f:
            if line.strip() and (name := mapping[json.loads(line)["adapter"]]) not in order:
                order.append(name)
    statuses: dict[str, int] = {}
    waiting, deadlines, full = iter(order), {}, False
    while True:
        while not full and len(deadlines) < window and (name := next(waiting, None)):
            deadlines[name] = time.monotonic() + limit_s
        if not deadlines:
            break
        for name, deadline in list(deadlines.items()):
            status = client.post(f"/loraserve/v1/adapters/{name}/prefetch").status_code
            if status != 202 or time.monotonic() >= deadline:
                del deadlines[name]
                statuses[name] = status
                full |= status == 409
        if deadlines:
            time.sleep(poll_s)
    listed = {a["name"]: a for a in
              client.get("/loraserve/v1/adapters").raise_for_status().json()["adapters"]}
    return {"adapters": len(order), "asked": len(statuses),
            "in_host": sum(listed[n]["residency"] == "host" for n in statuses),
            "by_status": {str(k): sum(s == k for s in statuses.values())
                          for k in sorted(set(statuses.values()))}}


def server_args(name: str, root: str, cold_start: str | None = None,
                host_bytes: int | None = None, flags: Sequence[str] = ()) -> list[str]:
    n, plugin, adapters = CONFIGS[name]
    if not plugin and not adapters:
        return []
    if not plugin:
        return [*LORA, "--max-loras", "32", "--max-cpu-loras", str(n), "--lora-modules",
                *(f"a{i:04d}={os.path.join(root, 'names', f'a{i:04d}')}" for i in range(n))]
    return [*pool_args(root, n, cold_start, host_bytes), *flags]


def model_map(name: str, catalog: str) -> dict[str, str]:
    n, _, adapters = CONFIGS[name]
    ranks = bench_e2e.DEFAULT_RANKS
    out = {}
    for spec in json.load(open(catalog)):
        if not adapters:
            out[spec["name"]] = BASE
            continue
        j = int(spec["name"].rsplit("-", 1)[1])
        out[spec["name"]] = f"a{j * len(ranks) + ranks.index(spec['rank']):04d}"
    assert len(set(out.values())) == (n if adapters else 1), "trace and served adapters differ"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="none,stock-100,pool-100,pool-1000")
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--root", default="/dev/shm/loraserve-e2e")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/online-out"))
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--cold-start", choices=COLD_STARTS,
                    help="--loraserve-cold-start of the plugin configs (default: the "
                         "server's default)")
    ap.add_argument("--start-in", choices=("disk", "host"), default="disk",
                    help="where the plugin configs' adapters are when the replay starts")
    ap.add_argument("--host-cache-bytes", type=int,
                    help="--loraserve-host-cache-bytes of the plugin configs")
    ap.add_argument("--pool-flags", default="",
                    help="more flags of the plugin configs' servers, one string")
    a = ap.parse_args()
    # A time limit's SIGTERM unwinds through `finally`, which stops the server:
    # it runs in a session of its own, so nothing else would.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    configs = a.configs.split(",")
    if unknown := sorted(set(configs) - set(CONFIGS)):
        sys.exit(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    os.makedirs(a.out, exist_ok=True)
    shape = bench_e2e.SHAPES["llama2-7b"]
    model, adapters = bench_e2e.asset_dirs(a.root, "llama2-7b", "qkvo", bench_e2e.DEFAULT_RANKS)
    bench_e2e.write_model(model, shape)
    bench_e2e.write_adapters(adapters, max(CONFIGS[c][0] for c in configs), shape,
                             bench_e2e.TARGETS["qkvo"][0], bench_e2e.DEFAULT_RANKS, 100)
    summary: dict = {"rate": a.rate, "duration": a.duration,
                     "cold_start": a.cold_start or "server default", "start_in": a.start_in,
                     "host_cache_bytes": a.host_cache_bytes, "pool_flags": a.pool_flags,
                     "configs": {}}
    for c in configs:
        n = CONFIGS[c][0]
        trace = os.path.join(a.out, f"trace-{n}.jsonl")
        catalog = os.path.join(a.out, f"trace-{n}.adapters.json")
        if not os.path.exists(trace):
            loraserve_cli("bench", "gen", "--kind", "loraserve", "--num-adapters", str(n),
                          "--rate", str(a.rate), "--duration", str(a.duration), "--seed", "1",
                          "--out", trace)
        mapping = os.path.join(a.out, f"map-{c}.json")
        served_as = model_map(c, catalog)
        json.dump(served_as, open(mapping, "w"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [vllm_executable(), "serve", model, *COMMON,
               "--host", "127.0.0.1", "--port", str(port),
               *server_args(c, adapters, a.cold_start, a.host_cache_bytes,
                            shlex.split(a.pool_flags))]
        server = Server(cmd, os.path.join(a.out, f"server-{c}.log"))
        result: dict = {"command": cmd[1:]}
        try:
            t = time.time()
            server.wait_ready(url, a.start_timeout_s, progress=False)
            result["start_s"] = round(time.time() - t, 1)
            if a.start_in == "host" and CONFIGS[c][1] and CONFIGS[c][2]:
                t = time.time()
                with httpx.Client(base_url=url, timeout=60) as client:
                    result["prefetched"] = prefetch(client, trace, served_as)
                result["prefetch_s"] = round(time.time() - t, 1)
                print(f"[online] {c}: prefetched {result['prefetched']}", flush=True)
            out = os.path.join(a.out, f"replay-{c}.json")
            plugin = CONFIGS[c][1]
            before = scrape(url) if plugin else None
            loraserve_cli("bench", "replay", "--trace", trace, "--url", url, "--out", out,
                          "--model-map", mapping, "--token-id-min", "4", "--token-id-max",
                          str(shape["vocab_size"]))
            if plugin:
                after = scrape(url)
                result["replay_metrics"] = grew(before, after) \
                    if isinstance(before, dict) and isinstance(after, dict) else \
                    {"error": before if isinstance(before, str) else after}
            records = json.load(open(out))
            result["summary"] = records["summary"]
            if CONFIGS[c][2]:
                result["first_and_later"] = replay.first_and_later(
                    [replay.Outcome(**r) for r in records["requests"]])
            result["status"] = "ok"
        except Exception as e:  # one config failing must not lose the others' results
            result["status"] = f"failed: {e}"
        finally:
            server.stop(timeout=5)
        summary["configs"][c] = result
        s = result.get("summary", {})
        print(f"[online] {c}: {result['status']}; TTFT {s.get('ttft_s')}; "
              f"{s.get('throughput_output_tok_s')} out tok/s; errors {s.get('errors')}",
              flush=True)
        for part, b in result.get("first_and_later", {}).items():
            print(f"[online] {c}: {part} requests of an adapter: n {b['n']}, TTFT p50 "
                  f"{b['ttft_s'].get('p50')} s, p99 {b['ttft_s'].get('p99')} s", flush=True)
        json.dump(summary, open(os.path.join(a.out, "online.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
