"""benchmarks/e2e/online_ttft.py without a server: with `--start-in host`,
the adapters of the trace's first requests are prefetched a window at a
time, in the order of their first request, until the host tier answers 409;
the pool's counters on /metrics are taken before and after the replay."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "e2e"))
import online_ttft  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("window,asked_order", [
    # First uses: a2, a0, a4, a3, a1; a0 asked until read; a1 not after the 409.
    (1, ["a2", "a0", "a0", "a0", "a4", "a3"]),
    # Two at a time: a0's read goes on beside a4's and a3's asks.
    (2, ["a2", "a0", "a0", "a4", "a0", "a3"]),
])
def test_prefetch_in_first_use_order_a_window_at_a_time_until_the_tier_is_full(
        tmp_path, window, asked_order):
    trace = tmp_path / "trace.jsonl"
    uses = ["r8-2", "r8-0", "r8-2", "r16-1", "r8-0", "r16-0", "r8-1"]
    trace.write_text("".join(json.dumps({"request_id": i, "arrival_s": i, "adapter": a}) + "\n"
                             for i, a in enumerate(uses)))
    mapping = {"r8-0": "a0", "r8-1": "a1", "r8-2": "a2", "r16-0": "a3", "r16-1": "a4"}
    asked: list[str] = []
    reading = {"a0": 2}  # a0's read answers 202 twice more before it is in the tier
    host: set[str] = set()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"adapters": [
                {"name": n, "residency": "host" if n in host else "disk"}
                for n in mapping.values()]})
        name = request.url.path.split("/")[-2]
        asked.append(name)
        if reading.get(name):
            reading[name] -= 1
            return httpx.Response(202, json={"state": "reading"})
        if name == "a4":
            return httpx.Response(400)  # unservable
        if name == "a3":
            return httpx.Response(409)  # the tier is full
        host.add(name)
        return httpx.Response(200, json={"state": "host"})

    with httpx.Client(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as c:
        counts = online_ttft.prefetch(c, str(trace), mapping, window=window, poll_s=0)
    assert asked == asked_order
    assert counts == {"adapters": 5, "asked": 4, "in_host": 2,
                      "by_status": {"200": 2, "400": 1, "409": 1}}


def test_replay_metrics_are_what_the_pools_counters_grew_by():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    r = CollectorRegistry()
    load = Histogram("loraserve_adapter_load_seconds", "", ["tier"], registry=r,
                     buckets=(0.01, 0.1))
    events = Counter("loraserve_pool_page_events", "", ["event"], registry=r)
    Gauge("loraserve_pool_host_bytes", "", registry=r).set(5)  # a level, not a count
    Counter("loraserve_adapter_requests", "", ["adapter"], registry=r).labels("a").inc()
    load.labels("host").observe(0.05)
    events.labels("load").inc(3)
    before = online_ttft.pool_metrics(generate_latest(r).decode())
    load.labels("host").observe(0.2)
    load.labels("device").observe(0.005)
    events.labels("load").inc(2)
    events.labels("evict").inc()
    grew = online_ttft.grew(before, online_ttft.pool_metrics(generate_latest(r).decode()))
    assert grew["loraserve_adapter_load_seconds_count{tier=host}"] == 1
    assert grew["loraserve_adapter_load_seconds_sum{tier=host}"] == 0.2
    assert grew["loraserve_adapter_load_seconds_bucket{le=0.1,tier=host}"] == 0
    assert grew["loraserve_adapter_load_seconds_count{tier=device}"] == 1
    assert grew["loraserve_pool_page_events_total{event=load}"] == 2
    assert grew["loraserve_pool_page_events_total{event=evict}"] == 1
    assert not [k for k in grew if "host_bytes" in k or "adapter_requests" in k
                or "_created" in k]
