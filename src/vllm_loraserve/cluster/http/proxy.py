"""The router's public routes: the OpenAI API proxied to engines, `/health`,
`/metrics`, and the adapter listing of a plugin server (`/loraserve/v1/adapters`).

A request whose engine cannot be reached, dies or leaves routing before
anything of the answer went to the client (a whole non-streamed answer, or a
stream's first line, is read before the client gets its status) is retried
once on another engine that holds the adapter (fetched onto one if none
does); if that fails too, or no other live engine can take it, it answers
503 naming each engine and why. A failure after the first streamed line
ends the stream with an error event (never retried: no output twice); a
silent engine answers 504 after the upstream timeout. Every request counted
in flight (`RouterCore.begin`) is released exactly once (`_Lease`), also
when the client goes away mid-stream. Every response names its engine in
`x-loraserve-engine`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_loraserve.cluster.http.body import BadBody, ask_for_usage, encode, parse_openai
from vllm_loraserve.cluster.http.state import RouterState, State, error
from vllm_loraserve.cluster.router import RouterCore

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
# An engine's answers that say it cannot serve now, not that the request is
# wrong: retried on another engine (nothing reached the client yet).
_UNAVAILABLE = (502, 503, 504)
_MAX_ENGINES = 2  # engines one request is tried on
T = TypeVar("T")

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
    generator ever ran (whose `finally` then never runs). If the engine
    leaves routing meanwhile, closes the upstream connection: the relay's
    read fails at once (a hung engine's stream would wait for the upstream
    timeout)."""

    def __init__(self, content, lease: _Lease, upstream: httpx.Response,
                 down: asyncio.Event, **kw) -> None:
        super().__init__(content, **kw)
        self._lease, self._upstream, self._down = lease, upstream, down

    async def _close_when_down(self) -> None:
        await self._down.wait()
        await self._upstream.aclose()

    async def __call__(self, scope, receive, send) -> None:
        # one waiting task per stream, not one race per line (~45 us a line)
        watcher = asyncio.create_task(self._close_when_down())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
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
    """Prompt plus completion tokens of an answer's usage; 0 for what is not
    a count (a lease is released with this: it must not raise)."""
    u = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(u, dict):
        return 0
    counts = (u.get("prompt_tokens", 0), u.get("completion_tokens", 0))
    return sum(n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n > 0)


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
    tried: dict[int, str] = {}  # engine -> why the request failed there
    while True:
        engine = await core.acquire(model, tried)
        if engine is None:
            return _unavailable(model, tried)
        lease = _Lease(core, model, engine, core.begin(model, engine))
        down = core.down_signal(engine)
        try:
            answer = await _start(state, engine, path, content, down)
        except _EngineLost as e:  # nothing reached the client: another engine may answer
            lease.release("retried")
            tried[engine] = str(e)
            if len(tried) >= _MAX_ENGINES:
                return _unavailable(model, tried)
            core.metrics.retries.inc()
            continue
        except httpx.HTTPError as e:
            lease.release("failed")
            return _transport_error(engine, e)
        except BaseException:  # cancelled: the client left
            lease.release("cancelled")
            raise
        headers = {"x-loraserve-engine": str(engine)}
        upstream = answer.upstream
        if answer.lines is not None:
            return _RelayResponse(_relay(core, answer, lease, bool(forward_usage), down), lease,
                                  upstream, down, media_type="text/event-stream",
                                  headers=headers)
        status = "ok" if upstream.status_code == 200 else f"http_{upstream.status_code}"
        try:
            payload = json.loads(answer.body)
        except ValueError:  # not JSON, or not even UTF-8
            lease.release(status)
            r = error(upstream.status_code, answer.body.decode(errors="replace")[:500],
                      "EngineError")
            r.headers.update(headers)
            return r
        lease.release(status, _usage_tokens(payload))
        return Response(answer.body, status_code=upstream.status_code, headers=headers,
                        media_type="application/json")


class _EngineLost(Exception):
    """The engine could not be reached, or left routing, before anything of
    its answer went to the client."""


@dataclass
class _Answer:
    upstream: httpx.Response
    body: bytes = b""  # the whole answer, when the engine does not stream
    lines: AsyncIterator[str] | None = None  # streamed: the lines after `first`
    first: str | None = None  # streamed: the first line (None: an empty stream)


async def _unless_down(aw: Awaitable[T], down: asyncio.Event, core: RouterCore,
                          engine: int) -> T:
    """`aw`'s result, or _EngineLost as soon as `engine` leaves routing (an
    engine that hangs without closing its connections fails its health
    checks: its requests end then, not at the upstream timeout)."""
    if not down.is_set():
        task = asyncio.ensure_future(aw)
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
    raise _EngineLost(f"engine {engine} left routing "
                      f"({core.down_reason.get(engine, 'failed its health check')})")


async def _start(state: RouterState, engine: int, path: str, content: bytes,
                 down: asyncio.Event) -> _Answer:
    """Send the request, and read until something can go to the client: the
    whole answer, or a stream's first line (so a stream too can be retried
    until then). The engine decides whether it streams (it reads `stream`
    its own way)."""
    core = state.core
    request = state.client.build_request("POST", f"{core.engines[engine].url}{path}",
                                         content=content,
                                         headers={"content-type": "application/json"})
    upstream = None
    try:
        upstream = await _unless_down(state.client.send(request, stream=True), down, core,
                                      engine)
        if (upstream.status_code == 200
                and upstream.headers.get("content-type", "").startswith("text/event-stream")):
            lines = upstream.aiter_lines()
            first = await _unless_down(anext(lines, None), down, core, engine)
            return _Answer(upstream, lines=lines, first=first)
        try:
            body = await _unless_down(upstream.aread(), down, core, engine)
        finally:
            await upstream.aclose()
        if upstream.status_code >= 500:  # a dying engine answers so before its checks fail
            core.suspect(engine)
            if upstream.status_code in _UNAVAILABLE:
                raise _EngineLost(f"engine {engine} answered HTTP {upstream.status_code}: "
                                  f"{body[:300].decode(errors='replace')}")
        return _Answer(upstream, body=body)
    except BaseException as e:
        if upstream is not None:
            await upstream.aclose()
        if isinstance(e, _RETRYABLE):
            core.suspect(engine)
            raise _EngineLost(f"engine {engine} failed: {type(e).__name__}: {e}") from e
        raise


def _unavailable(model: str, tried: dict[int, str]) -> JSONResponse:
    """503: no live engine could take the request; names each engine tried and why."""
    if not tried:
        return error(503, f"no live engine can serve `{model}` right now", "ServiceUnavailable")
    why = "; ".join(tried.values())
    more = "" if len(tried) >= _MAX_ENGINES else "; no other live engine can serve it"
    r = error(503, f"`{model}` could not be served: {why}{more}", "ServiceUnavailable")
    r.headers["x-loraserve-engine"] = str(list(tried)[-1])
    return r


async def _relay(core: RouterCore, answer: _Answer, lease: _Lease, forward_usage: bool,
                 down: asyncio.Event) -> AsyncIterator[bytes]:
    """Relay a stream from its first line. A failure from here on ends it
    with an error event: part of the answer reached the client, so it is
    never retried (no output twice). An engine leaving routing closes the
    upstream (`_RelayResponse`), which ends the loop here."""
    tokens, status = 0, "cancelled"  # unless the loop ends or fails
    engine = lease.engine
    try:
        line = answer.first
        while line is not None:
            if line.startswith("data: {") and '"usage"' in line:
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = _usage_tokens(chunk)
                    if not chunk.get("choices") and not forward_usage:
                        line = await anext(answer.lines, None)
                        continue
            yield (line + "\n").encode()
            line = await anext(answer.lines, None)
        status = "ok"
    except httpx.HTTPError as e:
        status = "failed"
        if down.is_set():
            why = (f"engine {engine} left routing "
                   f"({core.down_reason.get(engine, 'failed its health check')})")
        else:
            core.suspect(engine)
            why = f"{type(e).__name__}: {e}"
        err = {"error": {"message": f"engine {engine} failed during the response: {why}",
                         "type": "EngineFailure", "param": None, "code": 502}}
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        lease.release(status, tokens)  # the response closes upstream (_RelayResponse)
