"""The router's HTTP API (FastAPI, served by uvicorn inside the router actor).

OpenAI-compatible: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(streaming too), proxied to the chosen engine; `/health`, `/metrics`. Admin:
`/admin/status`, `/admin/adapters` (list, register, unregister),
`/admin/placement` (read, override), `/admin/rebalance`,
`/admin/engines/{i}/restart`; with an admin token, every admin route needs
`Authorization: Bearer <token>` (401 otherwise). A registered adapter must
have a safe name whose alias is not the base model's, must not be the alias
of registered versions (400; adapters/safety.py), must not be registered
(409), and must lie under the router's adapter roots (403 otherwise);
it is read and checked against the model (an engine's
`/loraserve/v1/model`) in a thread before it is copied anywhere. A
registered `name@version` (train/publish.py) moves the alias `name` to it;
a request for `name` is sent as the version it resolves to on arrival.

A request that fails before its first byte (engine down) is retried once on
another engine that holds the adapter; a failure after that ends the stream
with an error event, and other transport errors answer 502 (504 on a
timeout). Every request counted in flight (`RouterCore.begin`) is released
exactly once (`_Lease`), also when the client goes away mid-stream. Every
response names its engine in `x-loraserve-engine`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_loraserve.adapters.peft import (
    AdapterError,
    ModelLoRAInfo,
    PeftSpec,
    check_against_model,
    check_finite_weights,
    inspect_adapter,
)
from vllm_loraserve.adapters.record import AdapterRecord
from vllm_loraserve.adapters.safety import (
    PathOutsideRoots,
    check_name,
    resolve_adapter_under_roots,
)
from vllm_loraserve.cluster.placement import check_assignment
from vllm_loraserve.cluster.router import NameTaken, RouterCore

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": status}})


@dataclass
class _Lease:
    """One request in flight on one engine."""

    core: RouterCore
    model: str
    engine: int
    rank: int
    done: bool = False

    def release(self, status: str, tokens: int = 0) -> None:
        if not self.done:
            self.done = True
            self.core.end(self.model, self.engine, status, tokens, self.rank)


class _RelayResponse(StreamingResponse):
    """Releases the lease and the upstream connection however the response
    ends: Starlette cancels a stream whose client left, possibly before its
    generator ever ran (whose `finally` then never runs)."""

    def __init__(self, content, lease: _Lease, upstream: httpx.Response, **kw) -> None:
        super().__init__(content, **kw)
        self._lease, self._upstream = lease, upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._lease.release("cancelled")
            await self._upstream.aclose()


def _transport_error(engine: int, e: httpx.HTTPError) -> JSONResponse:
    if isinstance(e, httpx.TimeoutException):
        r = _error(504, f"engine {engine} did not answer in time ({type(e).__name__})",
                   "GatewayTimeout")
    else:
        r = _error(502, f"engine {engine} failed: {type(e).__name__}: {e}", "BadGateway")
    r.headers["x-loraserve-engine"] = str(engine)
    return r


def _usage_tokens(payload: dict) -> int:
    u = payload.get("usage") or {}
    return int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))


class _Unauthorized(Exception):
    pass


def _read_adapter(path: str) -> PeftSpec:
    """Header checks, then every tensor (NaN/Inf): blocking, run in a thread.
    Each engine's worker checks the tensors again as it reads them (in its
    own dtype), but the router reads them here anyway: registration is off
    every request's path, no engine may be live to refuse the adapter, and
    nothing refused is copied into the registry the engines fetch from. The
    router does not know the engines' dtype: the scaling is checked against
    bf16's range (float32's too)."""
    import torch

    spec = inspect_adapter(path)
    check_finite_weights(spec, torch.finfo(torch.bfloat16).max)
    return spec


def build_app(core: RouterCore, register_source=None, upstream_timeout_s: float = 600.0,
              admin_token: str | None = None, adapter_roots: Collection[str] = ()
              ) -> FastAPI:
    """`register_source(name, path)` copies a newly registered adapter into the
    adapter registry the engines fetch from (called in a thread). An engine
    silent for `upstream_timeout_s` answers 504. `admin_token`: required as a
    bearer token by every /admin route. `adapter_roots`: the directories
    `POST /admin/adapters` may read from."""
    app = FastAPI(title="vllm-loraserve router")

    async def require_token(request: Request) -> None:
        if admin_token is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {admin_token}".encode()):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        r = _error(401, "the admin API needs `Authorization: Bearer <token>` with the "
                   "router's admin token", "Unauthorized")
        r.headers["www-authenticate"] = "Bearer"
        return r

    admin = APIRouter(dependencies=[Depends(require_token)])
    model_info: list[ModelLoRAInfo] = []  # what engines accept, once known

    async def engine_model_info() -> ModelLoRAInfo:
        if not model_info:
            for e in core.live():
                try:
                    r = await client.get(f"{core.engines[e].url}/loraserve/v1/model",
                                         timeout=30.0)
                    raw = r.raise_for_status().json()
                    model_info.append(ModelLoRAInfo.from_wire(raw, raw["max_rank"]))
                    break
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
            else:
                raise RuntimeError("no live engine told its model's LoRA shapes")
        return model_info[0]
    # No pool limit: a queued request would wait for a free connection and fail
    # on the pool timeout, not for lack of an engine.
    client = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout_s, connect=5.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64))

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = core.live()
        return JSONResponse(status_code=200 if alive else 503, content={"alive": alive})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": core.base_model, "object": "model", "owned_by": "loraserve"}]
        data += [{"id": a, "object": "model", "owned_by": "loraserve", "parent": core.base_model,
                  "rank": r} for a, r in sorted(core.catalog.items())]
        data += [{"id": a, "object": "model", "owned_by": "loraserve", "parent": core.base_model,
                  "rank": core.catalog[v], "alias_of": v}
                 for a, v in sorted(core.aliases.items()) if a not in core.catalog]
        return {"object": "list", "data": data}

    async def proxy(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object", "BadRequestError")
        model = body.get("model")
        if not isinstance(model, str):
            return _error(400, "give the model (base model or adapter name) as `model`",
                          "BadRequestError")
        # An alias runs on the version it resolves to now, to its end.
        body["model"] = model = core.resolve(model)
        if model in core.invalid:
            return _error(400, f"adapter `{model}` cannot be served: {core.invalid[model]}",
                          "BadRequestError")
        if model != core.base_model and model not in core.catalog:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        stream = bool(body.get("stream"))
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream:  # usage feeds the demand estimate; dropped again if not asked for
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        tried: set[int] = set()
        while True:
            engine = await core.acquire(model, tried)
            if engine is None:
                return _error(503, f"no live engine can serve `{model}` right now",
                              "ServiceUnavailable")
            url = f"{core.engines[engine].url}{path}"
            lease = _Lease(core, model, engine, core.begin(model, engine))
            try:
                upstream = await client.send(client.build_request("POST", url, json=body),
                                             stream=True)
            except _RETRYABLE:
                lease.release("retried")
                core.suspect(engine)
                tried.add(engine)
                if len(tried) >= 2:
                    return _error(503, f"engines {sorted(tried)} failed to answer",
                                  "ServiceUnavailable")
                core.metrics.retries.inc()
                continue
            except httpx.HTTPError as e:
                lease.release("failed")
                return _transport_error(engine, e)
            except BaseException:  # cancelled: the client left
                lease.release("cancelled")
                raise
            headers = {"x-loraserve-engine": str(engine)}
            if upstream.status_code != 200 or not stream:
                try:
                    content = await upstream.aread()
                except httpx.HTTPError as e:
                    lease.release("failed")
                    return _transport_error(engine, e)
                except BaseException:
                    lease.release("cancelled")
                    raise
                finally:
                    await upstream.aclose()
                try:
                    payload = json.loads(content)
                except ValueError:  # not JSON, or not even UTF-8
                    payload = {"error": {"message": content.decode(errors="replace")[:500]}}
                status = "ok" if upstream.status_code == 200 else f"http_{upstream.status_code}"
                lease.release(status, _usage_tokens(payload))
                return JSONResponse(payload, status_code=upstream.status_code, headers=headers)
            return _RelayResponse(_relay(upstream, lease, client_wants_usage), lease, upstream,
                                  media_type="text/event-stream", headers=headers)

    async def _relay(upstream: httpx.Response, lease: _Lease,
                     forward_usage: bool) -> AsyncIterator[bytes]:
        tokens, status = 0, "cancelled"  # unless the loop ends or fails
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = _usage_tokens(chunk)
                        if not chunk.get("choices") and not forward_usage:
                            continue
                yield (line + "\n").encode()
            status = "ok"
        except httpx.HTTPError as e:
            status = "failed"
            core.suspect(lease.engine)
            err = {"error": {"message": f"engine {lease.engine} failed during the response: "
                                        f"{type(e).__name__}: {e}",
                             "type": "EngineFailure", "code": 502}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            lease.release(status, tokens)  # the response closes upstream (_RelayResponse)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy("/v1/chat/completions", request)

    @admin.get("/admin/status")
    async def status() -> dict:
        return core.status()

    @admin.get("/admin/adapters")
    async def adapters() -> dict:
        demand = core.demand.estimate()
        return {"adapters": [{"name": a, "rank": r, "holders": sorted(core.holders.get(a, ())),
                              "placement": core.assignment.get(a, []),
                              "demand_tokens_per_s": demand.get(a, 0.0)}
                             for a, r in sorted(core.catalog.items())]}

    @admin.post("/admin/adapters")
    async def register(request: Request) -> JSONResponse:
        """Body: {"name", "path"}: a PEFT adapter directory under the adapter roots."""
        try:
            body = await request.json()
            name, path = body.get("name"), body.get("path")
        except (json.JSONDecodeError, AttributeError):
            name = path = None
        if not name or not isinstance(path, str) or not path:
            return _error(400, "give `name` and `path` in a JSON object", "BadRequestError")
        try:
            check_name(name, reserved={core.base_model})
            core.check_new_name(name)  # before the copy; again when registered
        except NameTaken as e:
            return _error(409, str(e), "ConflictError")
        except ValueError as e:
            return _error(400, str(e), "BadRequestError")
        try:
            real = resolve_adapter_under_roots(path, adapter_roots)
        except PathOutsideRoots as e:
            return _error(403, str(e), "PermissionDenied")
        try:
            spec = await asyncio.to_thread(_read_adapter, real)
            check_against_model(spec, await engine_model_info())
        except AdapterError as e:
            return _error(400, f"adapter `{name}` cannot be served: {e}", "BadRequestError")
        except RuntimeError as e:
            return _error(503, f"adapter `{name}` cannot be checked now: {e}",
                          "ServiceUnavailable")
        if register_source is not None:
            try:
                await asyncio.to_thread(register_source, name, real)
            except (OSError, ValueError) as e:
                return _error(400, f"adapter `{name}` could not be copied: {e}",
                              "BadRequestError")
        try:
            await core.register(name, spec.rank)
        except NameTaken as e:
            return _error(409, str(e), "ConflictError")
        except ValueError as e:
            return _error(400, str(e), "BadRequestError")
        if name in core.invalid:
            return _error(400, f"adapter `{name}` cannot be served: {core.invalid[name]}",
                          "BadRequestError")
        return JSONResponse({"name": name, "rank": spec.rank,
                             "holders": sorted(core.holders[name])})

    @admin.delete("/admin/adapters/{name}")
    async def unregister(name: str) -> JSONResponse:
        if name not in core.catalog:
            return _error(404, f"unknown adapter `{name}`", "NotFoundError")
        await core.unregister(name)
        return JSONResponse({"name": name, "unregistered": True})

    @admin.get("/admin/placement")
    async def placement() -> dict:
        return core.status()["placement"]

    @admin.put("/admin/placement")
    async def set_placement(request: Request) -> JSONResponse:
        """Body: adapter -> [[engine, phi], ...]; adapters not named keep theirs.
        The next periodic rebalance replaces it (run with --rebalance-s 0 to pin it)."""
        try:
            raw = await request.json()
            given = {a: [(int(e), float(p)) for e, p in v] for a, v in raw.items()}
            unknown = sorted(set(given) - set(core.catalog))
            if unknown:
                raise ValueError(f"unknown adapters {unknown[:5]}")
            live = core.live()
            if any(e not in live for v in given.values() for e, _ in v):
                raise ValueError(f"placement names engines that are not alive (alive: {live})")
            assignment = {**core.assignment, **given}
            check_assignment(assignment, [AdapterRecord(a, r) for a, r in core.catalog.items()],
                             max(core.engines) + 1)
        except (ValueError, TypeError, AttributeError, json.JSONDecodeError) as e:
            return _error(400, f"invalid placement: {e}", "BadRequestError")
        added = await core.set_placement(assignment)
        return JSONResponse({"added_pairs": added})

    @admin.post("/admin/rebalance")
    async def rebalance() -> JSONResponse:
        return JSONResponse({"added_pairs": await core.rebalance()})

    @admin.post("/admin/engines/{index}/restart")
    async def restart(index: int) -> JSONResponse:
        if index not in core.engines:
            return _error(404, f"no engine {index}", "NotFoundError")
        try:
            info = await core.restart_engine(index)
        except Exception as e:
            return _error(502, f"engine {index} did not restart: {e}", "BadGateway")
        return JSONResponse(info)

    app.include_router(admin)
    app.state.core = core
    return app
