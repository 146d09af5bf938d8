"""The plugin's routes in a FastAPI app: vLLM's --api-key guards them."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.frontend import args as cli_args
from vllm_loraserve.frontend.endpoint import LoraServeEndpoint


def _app(monkeypatch, tokens: list[str] | None) -> TestClient:
    """Our routes, vLLM's /metrics stand-in and a /v1 route, with vLLM's key
    check installed as `build_app` installs it for --api-key (no engine: a
    route that passes the check answers 503)."""
    from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware

    monkeypatch.setattr(cli_args, "_active", LoraServeConfig())
    app = FastAPI()
    app.state.openai_serving_models = object()
    LoraServeEndpoint().attach_router(app)
    app.get("/metrics")(lambda: "metrics")
    app.get("/v1/models")(lambda: "models")
    if tokens:
        app.add_middleware(AuthenticationMiddleware, tokens=tokens)
    return TestClient(app)


ROUTES = ("/loraserve/v1/adapters", "/loraserve/v1/adapters/x", "/loraserve/v1/model")


@pytest.mark.parametrize("route", ROUTES)
def test_api_key_guards_the_plugin_routes(monkeypatch, route):
    client = _app(monkeypatch, ["s3cret"])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = client.get(route, headers=headers)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), headers
    assert client.get(route, headers={"Authorization": "Bearer s3cret"}).status_code == 503
    # as vLLM guards its own API, and leaves /metrics open
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_without_a_key_the_routes_are_open(monkeypatch, route):
    client = _app(monkeypatch, None)
    assert client.get(route).status_code == 503


def test_adapter_list_and_metrics_read_the_workers_report(monkeypatch, tmp_path):
    """The worker's `ResidencyReport`, in the wire form `collective_rpc`
    returns, feeds the listing (tiers, pages, orphans) and the metrics."""
    import asyncio

    import torch
    from prometheus_client import CollectorRegistry

    from vllm_loraserve.adapters.peft import ModelLoRAInfo, write_adapter
    from vllm_loraserve.frontend import endpoint, serving
    from vllm_loraserve.frontend.catalog import AdapterCatalog
    from vllm_loraserve.frontend.metrics import Metrics
    from vllm_loraserve.worker.report import LoadEvent, PoolCounters, ResidencyReport

    async def fetch():
        return ModelLoRAInfo({"q_proj": frozenset({(8, 8)})}, max_rank=8)

    catalog = AdapterCatalog(fetch, torch.finfo(torch.bfloat16).max)
    for name, lora_int_id in (("a", 11), ("b", 12)):
        path = str(tmp_path / name)
        write_adapter(path, {"model.layers.0.self_attn.q_proj": (torch.ones(4, 8),
                                                                 torch.ones(8, 4))},
                      rank=4, alpha=8, base_model="m")
        asyncio.run(catalog.admit(name, path, "runtime"))
        catalog.bind(name, lora_int_id)
    counters = PoolCounters(
        page_loads=2, page_evictions=0, page_loads_ahead=1, load_pack_s=0.01,
        load_write_s=0.002, adapter_pages=30, total_pages=500, page_size=1024,
        peak_batch_adapters=2, adapter_steps=3, adapter_step_adapters=4, adapter_step_ranks=16,
        adapter_step_bytes=8192, host_bytes=4096, host_adapters=2, host_budget=1 << 20,
        prefetch_hits=1, prefetch_misses=1)
    report = ResidencyReport(
        gpu=(3, 11), host=(12,), events=(LoadEvent(12, "host", 0.2), LoadEvent(11, "gpu", 0.01)),
        dropped_events=5, pages={3: 6, 11: 24}, adapter_waits=(0.0, 0.3), pool=counters)

    class Engine:
        async def collective_rpc(self, method):
            assert method == "loraserve_residency"
            return [report.to_wire()]

    registry = CollectorRegistry()
    monkeypatch.setattr(endpoint, "metrics", lambda: Metrics(registry))
    client = _app(monkeypatch, None)
    client.app.state.engine_client = Engine()
    models = client.app.state.openai_serving_models = type("Models", (), {})()
    setattr(models, serving.CATALOG_ATTR, catalog)

    listing = client.get("/loraserve/v1/adapters").json()
    by_name = {a["name"]: a for a in listing["adapters"]}
    assert (by_name["a"]["residency"], by_name["a"]["pages"]) == ("device", 24)
    assert by_name["b"]["residency"] == "host" and "pages" not in by_name["b"]
    assert listing["orphans"] == [{"lora_int_id": 3, "name": None, "residency": "device",
                                   "pages": 6}]

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("loraserve_adapter_loads_total", adapter="a", tier="device") == 1
    assert value("loraserve_adapter_loads_total", adapter="b", tier="host") == 1
    assert value("loraserve_adapter_load_events_dropped_total") == 5
    assert value("loraserve_pool_pages", kind="adapter") == 30
    assert value("loraserve_pool_page_events_total", event="load_ahead") == 1
    assert value("loraserve_adapter_wait_seconds_count") == 2
