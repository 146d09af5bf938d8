"""The router's public routes: the OpenAI API proxied to engines, `/health`,
`/metrics`, and the adapter listing of a plugin server (`/loraserve/v1/adapters`).

A request that fails before its first byte (engine down) is retried once on
another engine that holds the adapter; a failure after that ends the stream
with an error event, and other transport errors answer 502 (504 on a
timeout). Every request counted in flight (`RouterCore.begin`) is released
exactly once (`_Lease`), also when the client goes away mid-stream. Every
response names its engine in `x-loraserve-engine`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_loraserve.cluster.http.body import BadBody, ask_for_usage, encode, parse_openai
from vllm_loraserve.cluster.http.state import RouterState, State, error
from vllm_loraserve.cluster.router import RouterCore

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)

routes = APIRouter()


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
        r = error(504, f"engine {engine} did not answer in time ({type(e).__name__})",
                  "GatewayTimeout")
    else:
        r = error(502, f"engine {engine} failed: {type(e).__name__}: {e}", "BadGateway")
    r.headers["x-loraserve-engine"] = str(engine)
    return r


def _usage_tokens(payload: object) -> int:
    u = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(u, dict):
        return 0
    return int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))


@routes.get("/health")
async def health(state: State) -> JSONResponse:
    alive = state.core.live()
    return JSONResponse(status_code=200 if alive else 503, content={"alive": alive})


@routes.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.core.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(state: State) -> dict:
    core = state.core
    data = [{"id": core.base_model, "object": "model", "owned_by": "loraserve"}]
    data += [{"id": a, "object": "model", "owned_by": "loraserve", "parent": core.base_model,
              "rank": r} for a, r in sorted(core.catalog.items())]
    data += [{"id": a, "object": "model", "owned_by": "loraserve", "parent": core.base_model,
              "rank": core.catalog[v], "alias_of": v}
             for a, v in sorted(core.aliases.items()) if a not in core.catalog]
    return {"object": "list", "data": data}


@routes.get("/loraserve/v1/adapters")
async def adapter_listing(state: State) -> dict:
    """The plugin server's listing, with the fields the router knows (name,
    status, rank; the reason of an invalid one), so a client of one engine
    (`loraserve bench replay --map-by-rank`) works against the router too.
    Residency is per engine: each engine's own listing has it."""
    core = state.core
    ready = [{"name": a, "status": "ready", "rank": r} for a, r in core.catalog.items()]
    invalid = [{"name": a, "status": "invalid", "error": why} for a, why in core.invalid.items()]
    return {"adapters": sorted(ready + invalid, key=lambda x: x["name"])}


@routes.post("/v1/completions")
async def completions(request: Request, state: State) -> Response:
    return await _proxy(state, "/v1/completions", request)


@routes.post("/v1/chat/completions")
async def chat(request: Request, state: State) -> Response:
    return await _proxy(state, "/v1/chat/completions", request)


async def _proxy(state: RouterState, path: str, request: Request) -> Response:
    core = state.core
    try:
        body = parse_openai(await request.body(), request.headers.get("content-type", ""))
        # An alias runs on the version it resolves to now, to its end.
        body["model"] = model = core.resolve(body["model"])
        forward_usage = ask_for_usage(body)
        content = encode(body)
    except BadBody as e:
        return error(400, str(e), "BadRequestError", e.param)
    if model in core.invalid:
        return error(400, f"adapter `{model}` cannot be served: {core.invalid[model]}",
                     "BadRequestError", "model")
    if model != core.base_model and model not in core.catalog:
        return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    tried: set[int] = set()
    while True:
        engine = await core.acquire(model, tried)
        if engine is None:
            return error(503, f"no live engine can serve `{model}` right now",
                         "ServiceUnavailable")
        url = f"{core.engines[engine].url}{path}"
        lease = _Lease(core, model, engine, core.begin(model, engine))
        request_out = state.client.build_request(
            "POST", url, content=content, headers={"content-type": "application/json"})
        try:
            upstream = await state.client.send(request_out, stream=True)
        except _RETRYABLE:
            lease.release("retried")
            core.suspect(engine)
            tried.add(engine)
            if len(tried) >= 2:
                return error(503, f"engines {sorted(tried)} failed to answer",
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
        # The engine decides whether it streams (it reads `stream` its own way).
        if (upstream.status_code == 200
                and upstream.headers.get("content-type", "").startswith("text/event-stream")):
            return _RelayResponse(_relay(core, upstream, lease, bool(forward_usage)), lease,
                                  upstream, media_type="text/event-stream", headers=headers)
        try:
            answer = await upstream.aread()
        except httpx.HTTPError as e:
            lease.release("failed")
            return _transport_error(engine, e)
        except BaseException:
            lease.release("cancelled")
            raise
        finally:
            await upstream.aclose()
        status = "ok" if upstream.status_code == 200 else f"http_{upstream.status_code}"
        try:
            payload = json.loads(answer)
        except ValueError:  # not JSON, or not even UTF-8
            lease.release(status)
            r = error(upstream.status_code, answer.decode(errors="replace")[:500], "EngineError")
            r.headers.update(headers)
            return r
        lease.release(status, _usage_tokens(payload))
        return Response(answer, status_code=upstream.status_code, headers=headers,
                        media_type="application/json")


async def _relay(core: RouterCore, upstream: httpx.Response, lease: _Lease,
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
                         "type": "EngineFailure", "param": None, "code": 502}}
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        lease.release(status, tokens)  # the response closes upstream (_RelayResponse)
