"""What the router's routes share, and the shape of their errors.

`build_app` makes one `RouterState` and puts it on the app; every route
takes it as a parameter (`State`, a FastAPI dependency), so no handler
closes over anything and each module of routes can be read alone.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated

import httpx
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vllm_loraserve.adapters.peft import ModelLoRAInfo
from vllm_loraserve.cluster.router import RouterCore
from vllm_loraserve.cluster.store import AdapterStore


@dataclass
class RouterState:
    core: RouterCore
    # To the engines. No pool limit: a queued request would wait for a free
    # connection and fail on the pool timeout, not for lack of an engine.
    client: httpx.AsyncClient
    # The router's copies of registered adapters (WORKDIR/registry), one of
    # the sources the engines fetch from; None: none kept (tests).
    registry: AdapterStore | None
    admin_token: str | None  # every /admin route needs it as a bearer token
    adapter_roots: Collection[str]  # the directories POST /admin/adapters may read from
    model_info: ModelLoRAInfo | None = None  # what engines accept, once one told
    # Names whose POST /admin/adapters is under way (checked, copied, placed):
    # a second one would copy its files over the first's.
    registering: set[str] = field(default_factory=set)


def state_of(request: Request) -> RouterState:
    return request.app.state.router


State = Annotated[RouterState, Depends(state_of)]


def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    """The OpenAI error shape, as vLLM's `ErrorResponse` writes it (`param`:
    the request field at fault, if one)."""
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": status}})


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own checks (a path parameter of the wrong type) answer 400
    in the same shape, as vLLM's `validation_exception_handler` does."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return error(400, f"{where}: {first['msg']} (got {first.get('input')!r})",
                 "BadRequestError", where)
