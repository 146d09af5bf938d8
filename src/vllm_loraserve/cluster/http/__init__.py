"""The router's HTTP API (FastAPI, served by uvicorn inside the router actor).

- proxy.py: the public routes: the OpenAI API (`/v1/models`,
  `/v1/completions`, `/v1/chat/completions`, streaming too) proxied to the
  chosen engine, `/health`, `/metrics`, the adapter listing
  `/loraserve/v1/adapters` (the fields a plugin server's has that the router
  knows);
- body.py: what the proxy reads of a request body, refused (400) where an
  engine would refuse it, and the body it forwards;
- admin.py: the `/admin` routes (status, adapters, placement, rebalance,
  engine restarts), behind the admin token when one is set;
- state.py: `RouterState`, what all routes share (the RouterCore, the client
  to the engines, the registry, the admin settings), passed to every route as
  a parameter; the OpenAI error shape every error has.
"""

from __future__ import annotations

from collections.abc import Collection

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from vllm_loraserve.cluster.http import admin, proxy
from vllm_loraserve.cluster.http.state import RouterState, invalid_request
from vllm_loraserve.cluster.router import RouterCore
from vllm_loraserve.cluster.store import AdapterStore


def build_app(core: RouterCore, registry: AdapterStore | None = None,
              upstream_timeout_s: float = 600.0, admin_token: str | None = None,
              adapter_roots: Collection[str] = ()) -> FastAPI:
    """`registry`: where registered adapters are copied, for the engines to
    fetch (and deleted when unregistered). An engine silent for
    `upstream_timeout_s` answers 504. `admin_token`: required as a
    bearer token by every /admin route. `adapter_roots`: the directories
    `POST /admin/adapters` may read from."""
    app = FastAPI(title="vllm-loraserve router")
    client = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout_s, connect=5.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64))
    app.state.router = RouterState(core, client, registry, admin_token,
                                   tuple(adapter_roots))
    app.exception_handler(admin.Unauthorized)(admin.unauthorized)
    app.exception_handler(RequestValidationError)(invalid_request)
    app.include_router(proxy.routes)
    app.include_router(admin.routes)
    return app
