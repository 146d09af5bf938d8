"""The router's admin routes: `/admin/status`, `/admin/adapters` (list,
register, unregister), `/admin/placement` (read, override),
`/admin/rebalance`, `/admin/engines/{i}/restart`, `/admin/faults` (each
engine fault and how long its phases took, cluster/faults.py).

With an admin token, every route here needs `Authorization: Bearer <token>`
(401 otherwise). A registered adapter must have a safe name whose alias is
not the base model's, must not be the alias of registered versions (400;
adapters/safety.py), must not be registered (409), and must lie under the
router's adapter roots (403 otherwise); it is read and checked against the
model (an engine's `/loraserve/v1/model`) in a thread before it is copied
anywhere (the router's registry, WORKDIR/registry). A registered
`name@version` (train/publish.py) moves the alias `name` to it.
Unregistering deletes the registry's copy too, so the adapter stays gone
when the cluster starts again with that workdir; an adapter of `--adapters`
comes back then (the router never deletes in the user's directory).
"""

from __future__ import annotations

import asyncio
import hmac

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

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
from vllm_loraserve.cluster.http.body import BadBody, parse_json
from vllm_loraserve.cluster.http.state import RouterState, State, error
from vllm_loraserve.cluster.placement import check_assignment
from vllm_loraserve.cluster.router import NameTaken


class Unauthorized(Exception):
    """An admin request without the admin token (build_app answers 401)."""


async def _require_token(request: Request, state: State) -> None:
    if state.admin_token is None:
        return
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {state.admin_token}".encode()):
        raise Unauthorized()


async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
    r = error(401, "the admin API needs `Authorization: Bearer <token>` with the router's "
              "admin token", "Unauthorized")
    r.headers["www-authenticate"] = "Bearer"
    return r


routes = APIRouter(dependencies=[Depends(_require_token)])


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


async def _engine_model_info(state: RouterState) -> ModelLoRAInfo:
    """What the engines accept, asked of the first live engine that answers
    (once: every engine serves the same model)."""
    if state.model_info is None:
        core = state.core
        for e in core.live():
            try:
                r = await state.client.get(f"{core.engines[e].url}/loraserve/v1/model",
                                           timeout=30.0)
                raw = r.raise_for_status().json()
                state.model_info = ModelLoRAInfo.from_wire(raw, raw["max_rank"])
                break
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        else:
            raise RuntimeError("no live engine told its model's LoRA shapes")
    return state.model_info


@routes.get("/admin/status")
async def status(state: State) -> dict:
    return state.core.status()


@routes.get("/admin/faults")
async def faults(state: State) -> dict:
    return {"faults": [f.as_dict() for f in state.core.faults.faults]}


@routes.get("/admin/adapters")
async def adapters(state: State) -> dict:
    core = state.core
    demand = core.demand.estimate()
    return {"adapters": [{"name": a, "rank": r, "holders": sorted(core.holders.get(a, ())),
                          "placement": core.assignment.get(a, []),
                          "demand_tokens_per_s": demand.get(a, 0.0)}
                         for a, r in sorted(core.catalog.items())]}


@routes.post("/admin/adapters")
async def register(request: Request, state: State) -> JSONResponse:
    """Body: {"name", "path"}: a PEFT adapter directory under the adapter roots."""
    core = state.core
    try:
        body = parse_json(await request.body())
    except BadBody as e:
        return error(400, str(e), "BadRequestError")
    name, path = (body.get("name"), body.get("path")) if isinstance(body, dict) else (None, None)
    if not name or not isinstance(path, str) or not path:
        return error(400, "give `name` and `path` in a JSON object", "BadRequestError")
    try:
        check_name(name, reserved={core.base_model})
        core.check_new_name(name)  # before the copy; again when registered
    except NameTaken as e:
        return error(409, str(e), "ConflictError")
    except ValueError as e:
        return error(400, str(e), "BadRequestError")
    if name in state.registering:
        return error(409, f"a registration of `{name}` is under way", "ConflictError")
    state.registering.add(name)
    try:
        return await _register(state, name, path)
    finally:
        state.registering.discard(name)


async def _register(state: RouterState, name: str, path: str) -> JSONResponse:
    """Check, copy and place a name no other registration holds."""
    core = state.core
    try:
        real = resolve_adapter_under_roots(path, state.adapter_roots)
    except PathOutsideRoots as e:
        return error(403, str(e), "PermissionDenied")
    except ValueError as e:  # a NUL byte or a lone surrogate: no path the OS takes
        return error(400, f"invalid adapter path {path!r}: {e}", "BadRequestError")
    try:
        spec = await asyncio.to_thread(_read_adapter, real)
        check_against_model(spec, await _engine_model_info(state))
    except AdapterError as e:
        return error(400, f"adapter `{name}` cannot be served: {e}", "BadRequestError")
    except RuntimeError as e:
        return error(503, f"adapter `{name}` cannot be checked now: {e}", "ServiceUnavailable")
    if state.registry is not None:
        try:
            await asyncio.to_thread(state.registry.copy_in, name, real)
        except (OSError, ValueError) as e:
            return error(400, f"adapter `{name}` could not be copied: {e}", "BadRequestError")
    try:
        await core.register(name, spec.rank)
    except NameTaken as e:
        return error(409, str(e), "ConflictError")
    except ValueError as e:
        return error(400, str(e), "BadRequestError")
    if name in core.invalid:
        return error(400, f"adapter `{name}` cannot be served: {core.invalid[name]}",
                     "BadRequestError")
    return JSONResponse({"name": name, "rank": spec.rank, "holders": sorted(core.holders[name])})


@routes.delete("/admin/adapters/{name}")
async def unregister(name: str, state: State) -> JSONResponse:
    if name not in state.core.catalog:
        return error(404, f"unknown adapter `{name}`", "NotFoundError")
    await state.core.unregister(name)
    if state.registry is not None:  # else the next `cluster up` would serve it again
        await asyncio.to_thread(state.registry.remove, name)
    return JSONResponse({"name": name, "unregistered": True})


@routes.get("/admin/placement")
async def placement(state: State) -> dict:
    return state.core.status()["placement"]


@routes.put("/admin/placement")
async def set_placement(request: Request, state: State) -> JSONResponse:
    """Body: adapter -> [[engine, phi], ...]; adapters not named keep theirs.
    The next periodic rebalance replaces it (run with --rebalance-s 0 to pin it)."""
    core = state.core
    try:
        raw = parse_json(await request.body())
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
    except (ValueError, TypeError, AttributeError, OverflowError) as e:  # BadBody too
        return error(400, f"invalid placement: {e}", "BadRequestError")
    added = await core.set_placement(assignment)
    return JSONResponse({"added_pairs": added})


@routes.post("/admin/rebalance")
async def rebalance(state: State) -> JSONResponse:
    return JSONResponse({"added_pairs": await state.core.rebalance()})


@routes.post("/admin/engines/{index}/restart")
async def restart(index: int, state: State) -> JSONResponse:
    if index not in state.core.engines:
        return error(404, f"no engine {index}", "NotFoundError")
    try:
        info = await state.core.restart_engine(index)
    except Exception as e:
        return error(502, f"engine {index} did not restart: {e}", "BadGateway")
    return JSONResponse(info)
