"""Engine faults through the router's HTTP API, over fake engines whose
servers are processes (killed, stopped, started again): requests in flight
on a dying engine are retried elsewhere while nothing reached the client,
end with an error event once something did (never output twice), or answer
503 naming the engines and why; the engine leaves routing at once, no
adapter is lost, it rejoins, and each phase is timed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import uvicorn

from tests.cluster.fakes import UpstreamProcess, fake_engines
from tests.cluster.test_router import profile
from vllm_loraserve.cluster.http import build_app
from vllm_loraserve.cluster.router import RouterConfig, RouterCore
from vllm_loraserve.process import free_port

CATALOG = {"a8": 8, "b8": 8, "c64": 64, "d128": 128}


@pytest.fixture
def upstreams():
    procs = [UpstreamProcess(0), UpstreamProcess(1)]
    yield procs
    for p in procs:
        p.stop()


def run_router(procs, body, urls=None, **config):
    """A RouterCore (default health settings: 2 failed checks take an engine
    down) over fake engines backed by `procs`, every adapter on engine 0 only."""
    async def main():
        engines, world = fake_engines(2, urls or [p.url for p in procs])
        for e, p in zip(engines.values(), procs, strict=False):
            e.process = p
        core = RouterCore(engines, CATALOG, "base", profile(), RouterConfig(**{
            "rebalance_s": None, "health_interval_s": 60.0, "restart_attempts": 0,
            "restart_backoff_s": 0.0, **config}))
        await core.start()
        await core.set_placement({a: [(0, 1.0)] for a in CATALOG})
        await core.settle()
        # served on a port: the client reads a stream as it comes (httpx's
        # ASGI transport would hand it over only once it ended)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_app(core, upstream_timeout_s=30.0),
                                               host="127.0.0.1", port=port,
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=60) as client:
                await body(client, core, engines, world)
        finally:
            server.should_exit = True
            await serving
        await core.settle()
    asyncio.run(main())


def sse(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def texts(events: list) -> list[str]:
    return [c["text"] for e in events if e.startswith("{")
            for c in json.loads(e).get("choices", [])]


async def first_then_rest(client, body: dict, between) -> tuple[httpx.Response, list]:
    """Stream a request: read its first event, `await between()`, read the rest."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.aiter_lines()
        events = []
        async for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        await between()
        events += [line[6:] async for line in lines if line.startswith("data: ")]
    return r, events


async def wait_inflight(core, engine: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while core.inflight[engine] < n:
        assert time.monotonic() < deadline, f"{n} requests never reached engine {engine}"
        await asyncio.sleep(0.02)


def test_killed_engine_in_flight_requests_no_adapter_lost_and_rejoin(upstreams):
    async def body(client, core, engines, world):
        post = client.post
        plain = asyncio.create_task(post("/v1/completions",
                                         json={"model": "a8", "prompt": "hold-0"}))
        before_first = asyncio.create_task(post("/v1/completions", json={
            "model": "b8", "prompt": "hold-0", "stream": True}))
        killed = asyncio.Event()

        async def kill():
            await wait_inflight(core, 0, 3)
            upstreams[0].kill()
            killed.set()
        after_first = asyncio.create_task(first_then_rest(client, {
            "model": "c64", "prompt": "hold-after-first-0", "stream": True}, kill))
        plain, before_first, (_, events) = await asyncio.wait_for(
            asyncio.gather(plain, before_first, after_first), 20)
        assert killed.is_set()

        # nothing had reached the client: retried on engine 1, answered once
        assert plain.status_code == 200 and plain.headers["x-loraserve-engine"] == "1"
        assert [c["text"] for c in plain.json()["choices"]] == ["engine-1"]
        assert before_first.status_code == 200
        assert before_first.headers["x-loraserve-engine"] == "1"
        assert texts(sse(before_first.text)) == ["engine-1"]
        # one chunk had: the stream ends with an error naming the engine, and
        # no other engine's output follows it
        assert texts(events) == ["engine-0"] and events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "EngineFailure" and "engine 0" in err["message"]
        assert core.metrics.retries._value.get() == 2

        # out of routing: the failed requests' checks (background tasks) took it
        # out, no health tick ran (the router's health loop is not running)
        await core.settle()
        assert core.live() == [1]
        assert not +core.inflight
        # no adapter lost: each is on engine 1, copied from the registry as
        # only engine 0 held it (a8 and b8 maybe from engine 0's transport,
        # which outlives its server, when their retries fetched them before
        # engine 0 was down)
        fault, = core.faults.faults
        for a in CATALOG:
            assert core.holders[a] & core.alive == {1} and core.routing.engines(a) == [1]
        for a in fault.from_registry:
            assert (1, "fetch", a, "registry") in world
        assert set(CATALOG) - set(fault.from_registry) <= {"a8", "b8"}
        r = await post("/v1/completions", json={"model": "d128", "prompt": "hi"})
        assert r.status_code == 200 and r.headers["x-loraserve-engine"] == "1"

        assert fault.engine == 0 and fault.held == sorted(CATALOG) and fault.unplaced == []
        assert fault.replaced == dict.fromkeys(sorted(CATALOG), [1])
        assert 0 <= fault.detection_s < 30 and 0 <= fault.replacement_s < 30
        assert fault.first_served_s is not None and fault.rejoin_s is None

        # it comes back (its actor restarted it): the next check lets it rejoin,
        # and the placement round gives it adapters again
        upstreams[0].start()
        await core.check_now(0)
        assert core.live() == [0, 1]
        assert fault.rejoin_s > 0 and fault.given_on_rejoin
        assert all(0 in core.holders[a] for a in fault.given_on_rejoin)
        served = {(await post("/v1/completions", json={"model": a, "prompt": "hi"}))
                  .headers["x-loraserve-engine"] for a in fault.given_on_rejoin for _ in range(5)}
        assert "0" in served

        listed, = (await client.get("/admin/faults")).json()["faults"]
        assert listed["engine"] == 0 and listed["rejoin_s"] == fault.rejoin_s
        metrics = (await client.get("/metrics")).text
        for phase in ("detection", "replacement", "first_served", "rejoin"):
            assert f'loraserve_router_fault_phase_seconds_count{{phase="{phase}"}} 1.0' in metrics
    run_router(upstreams, body)


def test_hung_engine_in_flight_requests_end_when_it_leaves_routing(upstreams):
    """A stopped engine keeps its connections open: its requests end when its
    health checks take it out of routing, not at the upstream timeout."""
    async def body(client, core, engines, world):
        engines[0].health_timeout_s = 1.0  # the one that hangs; engine 1's stays generous
        ticks = asyncio.create_task(core.run())
        t0 = time.monotonic()
        plain = asyncio.create_task(client.post("/v1/completions",
                                                json={"model": "a8", "prompt": "hold-0"}))

        async def pause():
            await wait_inflight(core, 0, 2)
            upstreams[0].pause()
        streamed = asyncio.create_task(first_then_rest(client, {
            "model": "c64", "prompt": "hold-after-first-0", "stream": True}, pause))
        try:
            plain, (_, events) = await asyncio.wait_for(asyncio.gather(plain, streamed), 20)
        finally:
            upstreams[0].resume()
            ticks.cancel()
        assert time.monotonic() - t0 < 15  # the upstream timeout is 30 s
        assert plain.status_code == 200 and plain.headers["x-loraserve-engine"] == "1"
        assert texts(events) == ["engine-0"]
        err = json.loads(events[-2])["error"]["message"]
        assert "engine 0 left routing (failed its health check)" in err
        assert core.live() == [1]
    run_router(upstreams, body, health_interval_s=0.3)


def test_no_engine_left_answers_503_naming_each_engine_and_why():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens

    async def body(client, core, engines, world):
        r = await client.post("/v1/completions", json={"model": "a8", "prompt": "hi"})
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "engine 0 failed: ConnectError" in message
        assert "engine 1 failed: ConnectError" in message
        assert not +core.inflight
    run_router([], body, urls=dead)
