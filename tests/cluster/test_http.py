"""The router's HTTP API over in-memory engines whose `url` is a fake vLLM
server: proxying (plain and streamed), demand accounting, retries, failures
mid-stream, clear 4xx errors, and the admin routes."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from tests.cluster.fakes import UpstreamServer, fake_engines
from tests.cluster.test_router import profile
from vllm_loraserve.cluster.http import build_app
from vllm_loraserve.cluster.router import RouterConfig, RouterCore
from vllm_loraserve.cluster.sources import LocalDirSource
from vllm_loraserve.cluster.store import AdapterStore
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


class Registry(AdapterStore):
    """The router's registry, in a test's directory: records every copy, and
    takes `delay_s` for each, or (with `gate`) waits until the test opens it."""

    def __init__(self, root, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__(str(root))
        self.copied: list[tuple[str, str]] = []
        self.delay_s = delay_s
        self.gate = gate

    def copy_in(self, name: str, src: str) -> None:
        time.sleep(self.delay_s)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the registry's gate"
        self.copied.append((name, src))
        super().copy_in(name, src)


def run_router(urls, body, registry=None, **app_kw):
    """Start a RouterCore over fake engines at `urls`, then run `body(client, core)`."""
    async def main():
        engines, _ = fake_engines(len(urls), urls)
        core = RouterCore(engines, CATALOG, "base", profile(),
                          RouterConfig(rebalance_s=None, health_failures=1,
                                       restart_attempts=0))
        await core.start()
        app = build_app(core, registry=registry, **app_kw)
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


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error of a response, checked for vLLM's shape."""
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    return err


NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_the_router_reads_are_refused_as_an_engine_refuses_them(upstreams, path):
    """Bodies a `vllm serve --plugin loraserve` answers with 400 (probed on
    one, issue 25) that the router reads before any engine sees them: 400 in
    vLLM's error shape saying why (a 500 or a reset connection before), no
    engine counted, and the router serves on."""
    cases = [  # body, content type, in the message, param
        (b'{"model": "a8", "prompt": "\xff"}', "application/json", "not valid JSON in UTF-8",
         None),
        (b'{"model": "a8", "prompt": ' + NESTED + b"}", "application/json",
         "maximum recursion depth", None),
        (b'{"model": "a8", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json",
         "not valid JSON", None),
        (b'{"model": "a8", "prompt": "x"}', "text/plain", "Only 'application/json'", None),
        (b'{"model": "a8", "prompt": "x"}', None, "Only 'application/json'", None),
        (b'{"model": "\\ud800", "prompt": "x"}', "application/json",
         "`model` is not valid Unicode", "model"),
        (b"[]", "application/json", "not a JSON object", None),
        (b'{"model": 5}', "application/json", "as `model`", "model"),
    ]

    async def body(client, core):
        for content, media, reason, param in cases:
            headers = {"content-type": media} if media else {}
            r = await client.post(path, content=content, headers=headers)
            assert r.status_code == 400, (content[:40], r.text)
            err = error_of(r)
            assert reason in err["message"] and err["param"] == param, (content[:40], err)
            assert "x-loraserve-engine" not in r.headers
        assert not +core.inflight and not core.metrics.requests._metrics
        r = await client.post(path, json={"model": "a8", "prompt": "hi", "messages": []})
        assert r.status_code == 200
    run_router(upstreams, body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_engine_judges_what_the_router_forwards(upstreams, path):
    """Fields the router only forwards reach the engine as the client wrote
    them (NaN stays NaN, `stream_options` stays what it was), and the
    engine's 400 comes back: the router answered 500 before (it could not
    encode NaN, or read a `stream_options` that is no object)."""
    cases = [  # body, in the engine's message
        ('{"model": "a8", "prompt": "x", "temperature": NaN}', "got nan"),
        ('{"model": "a8", "prompt": "x", "temperature": -Infinity}', "got -inf"),
        ('{"model": "a8", "prompt": "x", "stream": true, "stream_options": "x"}',
         "input_value='x'"),
        ('{"model": "a8", "prompt": "x", "stream": true, "stream_options": 5}', "input_value=5"),
        ('{"model": "a8", "prompt": "x", "stream": true, "stream_options": []}',
         "input_value=[]"),
        ('{"model": "a8", "prompt": "x", "stream": true, "stream_options": true}',
         "input_value=True"),
        ('{"model": "a8", "prompt": "x", "stream_options": "x"}', "when `stream=True`"),
        ('{"model": "a8", "prompt": "x", "stream": true, '
         '"stream_options": {"include_usage": "maybe"}}', "input_value='maybe'"),
    ]

    async def body(client, core):
        for content, reason in cases:
            r = await client.post(path, content=content,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400, (content, r.text)
            assert reason in error_of(r)["message"], (content, r.text)
            assert r.headers["x-loraserve-engine"] in ("0", "1")
        assert not +core.inflight
        assert sum(core.metrics.requests.labels("a8", str(e), "http_400")._value.get()
                   for e in (0, 1)) == len(cases)
        # a lone surrogate in a field the router does not read: forwarded as
        # its escape (the engine says what it makes of it), not a 500
        r = await client.post(path, content=b'{"model": "a8", "prompt": "\\ud800"}',
                              headers={"content-type": "application/json"})
        assert r.status_code == 200
    run_router(upstreams, body)


def test_the_engine_decides_whether_it_streams(upstreams):
    """vLLM reads `stream` and `include_usage` as pydantic does ("no" is
    false): a request the engine answers in one piece is relayed as JSON,
    a usage chunk the client declined is dropped, and both count demand."""
    async def body(client, core):
        r = await client.post("/v1/completions",
                              json={"model": "a8", "prompt": "hi", "stream": "no"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json()["choices"][0]["text"].startswith("engine-")
        r = await client.post("/v1/completions", json={
            "model": "a8", "prompt": "hi", "stream": True,
            "stream_options": {"include_usage": "no"}})
        events = sse(r.text)
        assert events[-1] == "[DONE]" and not any('"usage"' in e for e in events)
        core.demand.roll()
        assert core.demand.last_window()["a8"] * core.demand.window_s == 16
    run_router(upstreams, body)


def test_admin_bodies_get_clear_errors(upstreams, tiny_assets):
    """Admin requests with bodies or paths nothing can use: 400 saying why
    (a 500 before for each but the path parameter, which FastAPI answered
    422 in its own shape)."""
    async def body(client, core):
        for method, path, content, reason in [
            ("POST", "/admin/adapters", b'{"name": "\xff", "path": "x"}', "not valid JSON"),
            ("POST", "/admin/adapters", b'{"name": ' + NESTED + b"}", "recursion depth"),
            ("POST", "/admin/adapters", b'{"name": "n", "path": "a\\u0000b"}',
             "invalid adapter path"),
            ("PUT", "/admin/placement", NESTED, "recursion depth"),
            ("PUT", "/admin/placement", b'{"a8": [[1e400, 1.0]]}', "infinity"),
            ("POST", "/admin/engines/abc/restart", b"", "valid integer"),
        ]:
            r = await client.request(method, path, content=content,
                                     headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, content[:40], r.text)
            assert reason in error_of(r)["message"], (path, content[:40], r.text)
        assert set(core.catalog) == set(CATALOG)
    run_router(upstreams, body, adapter_roots=[os.path.join(tiny_assets, "adapters")])


def test_unregister_deletes_the_registry_copy(upstreams, tiny_assets, tmp_path):
    """A deleted adapter is not served again by the next `cluster up` with
    the same workdir (it was: its registry copy stayed); an adapter of the
    user's `--adapters` directory is never deleted there."""
    import shutil

    registry = Registry(tmp_path / "registry")
    user = tmp_path / "adapters"  # `cluster up --adapters`, holding a8 of the catalogue
    shutil.copytree(os.path.join(tiny_assets, "adapters", "adapter-000-r8"), user / "a8")
    good = os.path.join(tiny_assets, "adapters", "adapter-001-r16")

    async def body(client, core):
        r = await client.post("/admin/adapters", json={"name": "late", "path": good})
        assert r.status_code == 200 and registry.has("late")
        assert (await client.delete("/admin/adapters/late")).status_code == 200
        assert (await client.delete("/admin/adapters/a8")).status_code == 200
        assert registry.names() == []
        assert (user / "a8" / "adapter_config.json").is_file()
        # the adapters the next `cluster up` serves (launch.py: --adapters, then the registry)
        valid, _ = LocalDirSource(os.pathsep.join([str(user), registry.root])).scan()
        assert [e.name for e in valid] == ["a8"]
        # registered again: a fresh copy
        r = await client.post("/admin/adapters", json={"name": "late", "path": good})
        assert r.status_code == 200 and registry.names() == ["late"]
    run_router(upstreams, body, registry=registry,
               adapter_roots=[os.path.join(tiny_assets, "adapters")])


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


def test_engine_answering_503_is_retried_and_a_5xx_gets_it_checked(upstreams):
    """A 503 says the engine cannot serve now: another holder answers. A 500
    may be the request's own: it reaches the client, but its engine is
    health-checked at once (a dying engine answers 500s until its checks
    fail)."""
    async def body(client, core):
        await core.set_placement({**core.assignment, "b8": [(0, 0.5), (1, 0.5)]})
        checked = []
        core.suspect = checked.append
        for _ in range(10):
            r = await client.post("/v1/completions",
                                  json={"model": "b8", "prompt": "http-503-0"})
            assert r.status_code == 200 and r.headers["x-loraserve-engine"] == "1"
        assert core.metrics.requests.labels("b8", "0", "retried")._value.get() > 0
        assert set(checked) == {0}
        checked.clear()
        while True:  # until engine 0 takes one
            r = await client.post("/v1/completions",
                                  json={"model": "b8", "prompt": "http-500-0"})
            if r.headers["x-loraserve-engine"] == "0":
                break
        assert r.status_code == 500 and r.json()["error"]["message"] == "engine 0 says 500"
        assert checked == [0]
    run_router(upstreams, body)


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
        await asyncio.wait_for(app(scope, receive, send), 6.0)  # the engine waits SLOW_S, 8 s
        assert not +core.inflight  # no engine has a request in flight
        assert sum(core.metrics.requests.labels("a8", str(e), "cancelled")._value.get()
                   for e in (0, 1)) == 1
    run_router(upstreams, body)


def test_admin_routes(upstreams, tiny_assets, tmp_path):
    registry = Registry(tmp_path / "registry")

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
        assert registry.copied == [("late", good)] and registry.names() == ["late"]
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
    run_router(upstreams, body, registry=registry,
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
    registry = Registry(tmp_path / "registry")

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
        assert registry.copied == []  # nothing refused was copied
        assert await post("fine", root / "ok") == (200, "")
        assert registry.copied == [("fine", str(root / "ok"))]
    run_router(upstreams, body, registry=registry, adapter_roots=[str(root)])


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


def test_register_copies_off_the_event_loop(upstreams, tiny_assets, tmp_path):
    """A slow copy must not stall other requests (the router is one event loop)."""
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
        # A copy on the loop would hold /health for its 6 s; a loaded machine
        # may delay the answer a few s without that.
        assert answered < 5.0, f"/health answered {answered:.2f} s in, behind the 6 s copy"
    run_router(upstreams, body, registry=Registry(tmp_path, delay_s=6.0),
               adapter_roots=[os.path.join(tiny_assets, "adapters")])


def test_two_registrations_of_one_name_at_once_copy_one_adapter(upstreams, tiny_assets,
                                                                 tmp_path):
    """Both pass the name check before either is registered: the one that
    arrives second is refused while the other is under way, and the registry
    holds the files of the adapter the catalogue names (the refused one's
    copy would land on them). The two requests race over two connections,
    so either may arrive first; the first one's copy waits until the other
    is answered (without the check, both would wait, and the test fails)."""
    gate = threading.Event()
    registry = Registry(tmp_path / "registry", gate=gate)

    async def body(client, core):
        paths = {r: os.path.join(tiny_assets, "adapters", f"adapter-00{i}-r{r}")
                 for i, r in ((0, 8), (1, 16))}
        tasks = {r: asyncio.create_task(client.post("/admin/adapters",
                                                    json={"name": "x", "path": p}))
                 for r, p in paths.items()}
        done, _ = await asyncio.wait(tasks.values(), timeout=30,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "neither registration was refused while the other copied"
        gate.set()
        answers = {r: await t for r, t in tasks.items()}
        codes = sorted(a.status_code for a in answers.values())
        assert codes == [200, 409], [a.text for a in answers.values()]
        won = next(r for r, a in answers.items() if a.status_code == 200)
        other = 16 if won == 8 else 8
        assert tasks[other] in done
        assert "registration of `x` is under way" in answers[other].json()["error"]["message"]
        assert answers[won].json()["rank"] == won
        assert core.catalog["x"] == won
        assert registry.copied == [("x", os.path.realpath(paths[won]))]
        r = await client.post("/admin/adapters", json={"name": "x", "path": paths[other]})
        assert r.status_code == 409 and "already registered" in r.json()["error"]["message"]
    run_router(upstreams, body, registry=registry,
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


def test_replay_maps_by_rank_through_the_router(upstreams, tmp_path):
    """`loraserve bench replay --map-by-rank` against the router (issue 25):
    the router serves the adapter listing the replay client reads (a 404
    before: only a plugin server had it), and every request is answered."""
    import uvicorn

    from vllm_loraserve.cli.main import main as cli
    from vllm_loraserve.workloads.trace import Request, write_trace

    trace = tmp_path / "trace.jsonl"
    ranks = {"t-8a": 8, "t-8b": 8, "t-64": 64, "t-128": 128}
    write_trace(str(trace), [Request(i, 0.01 * i, a, r, 4, 2)
                             for i, (a, r) in enumerate(list(ranks.items()) * 2)])
    out = tmp_path / "results.json"

    async def body(client, core):
        app = build_app(core)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="critical"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            assert not serving.done(), "the router did not start"
            await asyncio.sleep(0.02)
        core.invalid["zz"] = "rank 999 is above this server's maximum LoRA rank 128"
        try:
            listing = (await client.get("/loraserve/v1/adapters")).json()["adapters"]
            assert listing == [*({"name": a, "status": "ready", "rank": r}
                                 for a, r in sorted(CATALOG.items())),
                               {"name": "zz", "status": "invalid", "error": core.invalid["zz"]}]
            await asyncio.to_thread(cli, [
                "bench", "replay", "--trace", str(trace), "--url", f"http://127.0.0.1:{port}",
                "--map-by-rank", "--out", str(out)])
        finally:
            server.should_exit = True
            await serving
        result = json.loads(out.read_text())
        assert result["summary"]["errors"] == 0 and result["summary"]["requests"] == 8
        sent = {(q["adapter"], q["model"]) for q in result["requests"]}
        assert sent == {("t-8a", "a8"), ("t-8b", "b8"), ("t-64", "c64"), ("t-128", "d128")}
        assert all(q["output_tokens"] == 3 for q in result["requests"])  # usage forwarded
        for model in ("a8", "b8", "c64", "d128"):
            assert sum(core.metrics.requests.labels(model, str(e), "ok")._value.get()
                       for e in (0, 1)) == 2
    run_router(upstreams, body)
