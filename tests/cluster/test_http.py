"""The router's HTTP API over in-memory engines whose `url` is a fake vLLM
server: proxying (plain and streamed), demand accounting, retries, failures
mid-stream, clear 4xx errors, and the admin routes."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from tests.cluster.fakes import UpstreamServer, fake_engines
from tests.cluster.test_router import profile
from vllm_loraserve.cluster.http import build_app
from vllm_loraserve.cluster.router import RouterConfig, RouterCore
from vllm_loraserve.process import free_port

CATALOG = {"a8": 8, "b8": 8, "c64": 64, "d128": 128}


def tiny_model_info(tiny_assets) -> dict:
    """What a plugin server for the tiny model answers on /loraserve/v1/model."""
    from vllm_loraserve.adapters.peft import short_name
    from vllm_loraserve.demo.assets import ALL_TARGETS, module_dims

    shapes: dict = {}
    dims = module_dims(os.path.join(tiny_assets, "model"), ALL_TARGETS)
    for module, shape in dims.items():
        shapes.setdefault(short_name(module), set()).add(shape)
    return {"max_rank": 128, "shapes": {k: sorted(v) for k, v in shapes.items()},
            "modules": sorted(dims)}


@pytest.fixture(scope="module")
def upstreams(tiny_assets):
    info = tiny_model_info(tiny_assets)
    servers = [UpstreamServer(0, info), UpstreamServer(1, info)]
    yield [s.url for s in servers]
    for s in servers:
        s.stop()


def run_router(urls, body, registry=None, **app_kw):
    """Start a RouterCore over fake engines at `urls`, then run `body(client, core)`."""
    async def main():
        engines, _ = fake_engines(len(urls), urls)
        core = RouterCore(engines, CATALOG, "base", profile(),
                          RouterConfig(rebalance_s=None, health_failures=1,
                                       restart_attempts=0))
        await core.start()
        app = build_app(core, register_source=registry, **app_kw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            await body(client, core)
        await core.settle()
    asyncio.run(main())


def sse(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_proxies_to_the_routed_engine_and_counts_demand(upstreams):
    async def body(client, core):
        await core.set_placement({**core.assignment, "a8": [(0, 0.5), (1, 0.5)]})
        seen = set()
        for _ in range(30):
            r = await client.post("/v1/completions", json={"model": "a8", "prompt": "hi"})
            assert r.status_code == 200
            engine = r.headers["x-loraserve-engine"]
            assert r.json()["choices"][0]["text"] == f"engine-{engine}"
            seen.add(engine)
        assert seen == {"0", "1"}
        r = await client.post("/v1/completions", json={"model": "base", "prompt": "hi"})
        assert r.status_code == 200
        core.demand.roll()
        assert core.demand.last_window()["a8"] * core.demand.window_s == 30 * 8
        assert "base" not in core.demand.last_window()
        assert core.inflight == {0: 0, 1: 0}
    run_router(upstreams, body)


def test_streaming_relays_events_and_hides_usage_unless_asked(upstreams):
    async def body(client, core):
        plain = await client.post("/v1/completions",
                                  json={"model": "c64", "prompt": "hi", "stream": True})
        events = sse(plain.text)
        assert events[-1] == "[DONE]"
        assert not any('"usage"' in e for e in events)
        asked = await client.post("/v1/completions", json={
            "model": "c64", "prompt": "hi", "stream": True,
            "stream_options": {"include_usage": True}})
        assert json.loads(sse(asked.text)[-2])["usage"]["total_tokens"] == 8
        core.demand.roll()  # both streams fed the demand estimate
        assert core.demand.last_window()["c64"] * core.demand.window_s == 16
    run_router(upstreams, body)


def test_bad_requests_get_clear_errors(upstreams):
    async def body(client, core):
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "`nope` does not exist" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and "`model`" in r.json()["error"]["message"]
        core.catalog.pop("d128")
        core.invalid["d128"] = "rank 128 is above this server's maximum LoRA rank 64"
        r = await client.post("/v1/chat/completions", json={"model": "d128", "messages": []})
        assert r.status_code == 400 and "maximum LoRA rank 64" in r.json()["error"]["message"]
    run_router(upstreams, body)


def test_engine_refusing_connections_is_retried_on_another_holder(upstreams):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def body(client, core):
        await core.set_placement({**core.assignment, "b8": [(0, 0.5), (1, 0.5)]})
        for _ in range(20):
            r = await client.post("/v1/completions", json={"model": "b8", "prompt": "hi"})
            assert r.status_code == 200 and r.headers["x-loraserve-engine"] == "1"
        assert core.metrics.retries._value.get() > 0
        assert core.metrics.requests.labels("b8", "0", "retried")._value.get() > 0
        assert core.metrics.requests.labels("b8", "1", "ok")._value.get() == 20
    run_router([dead, upstreams[1]], body)


def test_engine_dying_mid_stream_ends_the_stream_with_an_error(upstreams):
    async def body(client, core):
        r = await client.post("/v1/completions",
                              json={"model": "a8", "prompt": "break", "stream": True})
        events = sse(r.text)
        assert json.loads(events[0])["choices"][0]["text"].startswith("engine-")
        err = json.loads(events[-2])["error"]
        assert err["type"] == "EngineFailure" and "failed during the response" in err["message"]
        assert events[-1] == "[DONE]"
        engine = r.headers["x-loraserve-engine"]
        assert core.metrics.requests.labels("a8", engine, "failed")._value.get() == 1
        assert core.inflight[int(engine)] == 0
    run_router(upstreams, body)


def test_engine_too_slow_answers_504_and_releases_it(upstreams):
    async def body(client, core):
        r = await client.post("/v1/completions", json={"model": "a8", "prompt": "slow"})
        assert r.status_code == 504 and "did not answer in time" in r.json()["error"]["message"]
        engine = r.headers["x-loraserve-engine"]
        assert core.metrics.requests.labels("a8", engine, "failed")._value.get() == 1
        assert not +core.inflight and core.inflight_pairs["a8", int(engine)] == 0
    run_router(upstreams, body, upstream_timeout_s=0.5)


@pytest.mark.parametrize("leave_after_s", [0.0, 0.3])
def test_client_leaving_a_stream_releases_its_engine(upstreams, leave_after_s):
    """Before the relay ever ran (0 s) or while it waits for the engine."""
    async def body(client, core):
        app = build_app(core)
        request = [{"type": "http.request", "more_body": False, "body": json.dumps(
            {"model": "a8", "prompt": "slow", "stream": True}).encode()}]

        async def receive():
            if request:
                return request.pop()
            await asyncio.sleep(leave_after_s)
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("router", 80), "headers": [(b"content-type", b"application/json")]}
        await asyncio.wait_for(app(scope, receive, send), 2.5)  # the engine waits 3 s
        assert not +core.inflight  # no engine has a request in flight
        assert sum(core.metrics.requests.labels("a8", str(e), "cancelled")._value.get()
                   for e in (0, 1)) == 1
    run_router(upstreams, body)


def test_admin_routes(upstreams, tiny_assets, tmp_path):
    copied = []

    async def body(client, core):
        status = (await client.get("/admin/status")).json()
        assert status["alive"] == [0, 1] and set(status["placement"]) == set(CATALOG)
        models = (await client.get("/v1/models")).json()["data"]
        assert {m["id"]: m.get("rank") for m in models} == {"base": None, **CATALOG}

        r = await client.put("/admin/placement", json={"a8": [[0, 0.25], [1, 0.75]]})
        assert r.status_code == 200
        assert (await client.get("/admin/placement")).json()["a8"] == [[0, 0.25], [1, 0.75]]
        for bad, reason in [({"a8": [[0, 0.5]]}, "phi sums to 0.5"),
                            ({"a8": [[7, 1.0]]}, "not alive"),
                            ({"zz": [[0, 1.0]]}, "unknown adapters"),
                            ({"a8": "zero"}, "invalid placement")]:
            r = await client.put("/admin/placement", json=bad)
            assert r.status_code == 400 and reason in r.json()["error"]["message"], bad

        r = await client.post("/admin/adapters", json={"name": "late", "path": str(tmp_path)})
        assert r.status_code == 400 and "cannot be served" in r.json()["error"]["message"]
        r = await client.post("/admin/adapters", json={"name": "../up", "path": "x"})
        assert r.status_code == 400 and "invalid adapter name" in r.json()["error"]["message"]
        good = os.path.join(tiny_assets, "adapters", "adapter-001-r16")
        r = await client.post("/admin/adapters", json={"name": "late", "path": good})
        assert r.status_code == 200 and r.json()["rank"] == 16 and r.json()["holders"]
        assert copied == [("late", good)]
        r = await client.post("/admin/adapters", json={"name": "late", "path": good})
        assert r.status_code == 409
        assert (await client.delete("/admin/adapters/late")).status_code == 200
        assert (await client.delete("/admin/adapters/late")).status_code == 404
        assert "late" not in (await client.get("/admin/placement")).json()

        text = (await client.get("/metrics")).text
        for name in ("loraserve_router_engine_up", "loraserve_router_placement_phi",
                     "loraserve_router_fetches_total", "loraserve_router_migrations_total"):
            assert name in text
        assert (await client.post("/admin/engines/9/restart")).status_code == 404
    run_router(upstreams, body, registry=lambda name, path: copied.append((name, path)),
               adapter_roots=[str(tmp_path), os.path.join(tiny_assets, "adapters")])


def test_admin_routes_need_the_token(upstreams):
    async def body(client, core):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            for method, path in (("GET", "/admin/status"), ("POST", "/admin/adapters"),
                                 ("DELETE", "/admin/adapters/a8"), ("POST", "/admin/rebalance"),
                                 ("PUT", "/admin/placement")):
                r = await client.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers)
                assert "Bearer" in r.json()["error"]["message"]
                assert r.headers["www-authenticate"] == "Bearer"
        assert "a8" in core.catalog  # the unauthorised DELETE did nothing
        ok = {"authorization": "Bearer s3cret"}
        assert (await client.get("/admin/status", headers=ok)).status_code == 200
        # the OpenAI API and health stay open
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json={"model": "a8", "prompt": "hi"})
        assert r.status_code == 200
    run_router(upstreams, body, admin_token="s3cret")


def test_register_checks_name_roots_and_model_before_copying(upstreams, tiny_assets,
                                                              tmp_path):
    from tests.e2e.bad_adapters import build_bad_adapters, build_inf_weights

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    import shutil

    shutil.copytree(good, outside / "ok")
    shutil.copytree(good, root / "ok")
    os.symlink(outside / "ok", root / "link-out")
    shutil.copytree(good, root / "file-out")
    os.remove(root / "file-out" / "adapter_model.safetensors")
    os.symlink(outside / "ok" / "adapter_model.safetensors",
               root / "file-out" / "adapter_model.safetensors")
    build_bad_adapters(tiny_assets, str(root / "bad"))
    build_inf_weights(tiny_assets, str(root))
    copied = []

    async def body(client, core):
        async def post(name, path):
            r = await client.post("/admin/adapters", json={"name": name, "path": str(path)})
            return r.status_code, r.json().get("error", {}).get("message", "")

        for path in (outside / "ok", f"{root}/../outside/ok", root / "link-out", "/etc",
                     root / "file-out"):
            status, message = await post("x", path)
            assert status == 403 and "outside the adapter roots" in message, (path, message)
        for name, reason in (("a/b", "invalid adapter name"), ("x" * 201, "201 characters"),
                             ("base", "name of a served base model"),
                             ("base@1", "its alias 'base' is the name of a served base"),
                             ("ok\n", "invalid adapter name")):
            status, message = await post(name, root / "ok")
            assert status == 400 and reason in message
        for path, reason in ((root / "bad" / "wrong-base", "does not fit this base model"),
                             (root / "bad" / "rank-256", "above this server's maximum"),
                             (root / "bad" / "nan-alpha", "finite number"),
                             (root / "inf-weights", "non-finite values")):
            status, message = await post("x", path)
            assert status == 400 and reason in message, (path, message)
        assert copied == []  # nothing refused was copied
        assert await post("fine", root / "ok") == (200, "")
        assert copied == [("fine", str(root / "ok"))]
    run_router(upstreams, body, registry=lambda name, path: copied.append((name, path)),
               adapter_roots=[str(root)])


def test_an_alias_never_shadows_the_base_model_or_another_line(upstreams, tiny_assets):
    """`base@1` would take over `base`, a plain `pub` would silently replace
    what the alias `pub` serves: both refused; a version of a plain adapter
    is accepted and leaves the plain one its name (adapters/safety.py)."""
    async def body(client, core):
        good = os.path.join(tiny_assets, "adapters", "adapter-001-r16")

        async def post(name):
            r = await client.post("/admin/adapters", json={"name": name, "path": good})
            return r.status_code, r.json().get("error", {}).get("message", "")

        assert (await post("base@1"))[0] == 400
        models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert models.count("base") == 1 and "base@1" not in models
        r = await client.post("/v1/completions", json={"model": "base", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["model"] == "base"
        assert await post("pub@1") == (200, "")
        status, message = await post("pub")
        assert status == 400 and "alias of the served version 'pub@1'" in message
        assert (await post("pub@1"))[0] == 409
        r = await client.post("/v1/completions", json={"model": "pub", "prompt": "hi"})
        assert r.json()["model"] == "pub@1"
        assert await post("a8@2") == (200, "")  # a version of the plain adapter a8
        r = await client.post("/v1/completions", json={"model": "a8", "prompt": "hi"})
        assert r.json()["model"] == "a8"
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]].count(
            "a8") == 1
    run_router(upstreams, body, adapter_roots=[os.path.join(tiny_assets, "adapters")])


def test_register_copies_off_the_event_loop(upstreams, tiny_assets):
    """A slow copy must not stall other requests (the router is one event loop)."""
    import time

    def slow_copy(name, path):
        time.sleep(1.5)

    async def body(client, core):
        good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")

        t0 = time.perf_counter()

        async def health_answered_at():
            await asyncio.sleep(0.3)  # the copy is under way
            assert (await client.get("/health")).status_code == 200
            return time.perf_counter() - t0

        r, answered = await asyncio.gather(
            client.post("/admin/adapters", json={"name": "slow", "path": good}),
            health_answered_at())
        assert r.status_code == 200
        assert answered < 1.0, f"/health answered {answered:.2f} s in, behind the 1.5 s copy"
    run_router(upstreams, body, registry=slow_copy,
               adapter_roots=[os.path.join(tiny_assets, "adapters")])


def test_published_versions_move_the_alias(upstreams, tiny_assets):
    """train/publish.py registers `name@step` versions: the alias `name`
    routes to the newest, a request keeps the version it resolved to, and
    unregistering the newest moves the alias back (then away)."""
    async def body(client, core):
        good = os.path.join(tiny_assets, "adapters", "adapter-001-r16")
        for version in ("pub@1", "pub@2"):
            r = await client.post("/admin/adapters", json={"name": version, "path": good})
            assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"model": "pub", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["model"] == "pub@2"
        models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert models["pub"]["alias_of"] == "pub@2" and models["pub"]["rank"] == 16
        assert "pub@1" in models and "pub@2" in models
        assert (await client.delete("/admin/adapters/pub@2")).status_code == 200
        r = await client.post("/v1/completions", json={"model": "pub", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["model"] == "pub@1"
        assert (await client.delete("/admin/adapters/pub@1")).status_code == 200
        r = await client.post("/v1/completions", json={"model": "pub", "prompt": "hi"})
        assert r.status_code == 404
    run_router(upstreams, body, adapter_roots=[os.path.join(tiny_assets, "adapters")])
