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
