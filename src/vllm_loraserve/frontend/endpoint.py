"""HTTP surface of the plugin in vLLM's API server (`vllm.endpoint_plugins`).

Routes:
- `GET /loraserve/v1/adapters`: every known adapter with rank, alpha, target
  modules, size, its path relative to its adapter root and where it resides
  now (disk / host / device, with the device type), invalid ones with the
  reason; `orphans`: copies on the worker that no listed adapter owns (an
  unloaded one's, while a request it admitted still runs);
- `GET /loraserve/v1/adapters/{name}`: one of them (404 if unknown);
- `GET /loraserve/v1/model`: the rank limit, module paths and shapes adapters
  are checked against.

vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them. `--plugin
loraserve` is that explicit opt-in, so `install_gate` adds this plugin to
vLLM's list when the plugin is active in this process.

With `--api-key` (or `VLLM_API_KEY`) these routes need the key as `/v1` does:
vLLM's own check guards them (`_guard_with_api_key`). `/metrics` stays open,
as vLLM leaves it.

Residency and load events live in the workers; `_refresh` pulls them over
`collective_rpc` when the adapter list or `/metrics` is read.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_loraserve._patching import wrap
from vllm_loraserve.frontend import args as cli_args
from vllm_loraserve.frontend import errors, serving
from vllm_loraserve.frontend.metrics import metrics
from vllm_loraserve.paging.step import TRANSIENT_NOTE
from vllm_loraserve.worker.report import ResidencyReport

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format

GUARDED_PREFIX = "/loraserve/"
router = APIRouter(prefix=f"{GUARDED_PREFIX}v1")
# The workers' report (`loraserve_residency`) names the tier the kernels
# read "gpu", also on a CPU machine; offline scripts read that key, so the
# report keeps it and clients see the tier as "device" (catalog.RESIDENCIES).
_TIER_OF_REPORT = {"host": "host", "gpu": "device"}


def _guard_with_api_key() -> None:
    """vLLM's `AuthenticationMiddleware` (vllm/entrypoints/serve/utils/
    server_utils.py), installed when a key is given, checks only paths under
    its module's `GUARDED_PREFIX` (`/v1`, ...). Our prefix joins that tuple,
    so these routes need the key exactly when `/v1` does, with vLLM's check
    and its 401."""
    import sys

    from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware

    module = sys.modules[AuthenticationMiddleware.__module__]
    if GUARDED_PREFIX not in module.GUARDED_PREFIX:
        module.GUARDED_PREFIX = (*module.GUARDED_PREFIX, GUARDED_PREFIX)


def _roots() -> list[str]:
    cfg = cli_args.active_config()
    return [*cfg.adapter_dirs, *cfg.allowed_roots]


def _device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type


async def _refresh(state: Any) -> None:
    """Pull residency and load events from the workers into catalogue and metrics."""
    catalog = serving.catalog_of(state.openai_serving_models)
    report = ResidencyReport.from_wire(
        (await state.engine_client.collective_rpc("loraserve_residency"))[0])
    catalog.update_residency(report.gpu, report.host, report.pages)
    events = [(catalog.name_of(e.lora_id) or f"lora-id-{e.lora_id}", _TIER_OF_REPORT[e.tier],
               e.seconds) for e in report.events]
    m = metrics()
    m.record_loads(events, report.dropped_events)
    m.set_states(catalog.counts())
    if report.pool is not None:
        m.set_pool(report.pool)
        m.record_waits(report.adapter_waits)


def _error_json(status: int, err_type: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": err_type, "code": status}})


def _engine_unavailable(e: Exception) -> JSONResponse:
    return _error_json(503, "ServiceUnavailable", f"engine did not answer: {e}")


@router.get("/adapters")
async def list_adapters(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    try:
        await _refresh(state)
    except Exception as e:  # a dead engine must not turn this into a traceback
        return _engine_unavailable(e)
    catalog = serving.catalog_of(state.openai_serving_models)
    roots = _roots()
    return JSONResponse({
        "adapters": [e.to_json(roots) for _, e in sorted(catalog.entries.items())],
        "counts": catalog.counts(),
        "orphans": catalog.orphans,
        "device_type": _device_type(),
    })


@router.get("/model")
async def model_info(raw_request: Request) -> JSONResponse:
    """What adapters must fit: rank limit, module paths and shapes (the router checks
    an adapter against this before it copies it anywhere)."""
    catalog = serving.catalog_of(raw_request.app.state.openai_serving_models)
    try:
        info = await catalog.model_info()
    except Exception as e:
        return _engine_unavailable(e)
    return JSONResponse(info.to_wire())


@router.get("/adapters/{name}")
async def get_adapter(name: str, raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    try:
        await _refresh(state)
    except Exception as e:
        return _engine_unavailable(e)
    entry = serving.catalog_of(state.openai_serving_models).entries.get(name)
    if entry is None:
        return _error_json(404, "NotFoundError", f"unknown LoRA adapter '{name}'")
    return JSONResponse({**entry.to_json(_roots()), "device_type": _device_type()})


@router.post("/adapters/{name}/prefetch")
async def prefetch_adapter(name: str, raw_request: Request) -> JSONResponse:
    """Read an adapter from disk into the workers' host tier before its first
    request (a server's warm-up, or a client that knows what comes next).
    202 while a read is under way, 200 once every worker holds it ("state":
    "host"); 400 with the reason where a read found it unservable (then its
    requests get 400 too), 503 where a read failed for a reason that is not
    the adapter's (an I/O error: the next ask reads again), 409 where a host
    tier has no room beside the adapters it keeps: those waiting requests
    need, and those read since the engine's last step, so that an idle
    server keeps every adapter it prefetched (the read is not queued: ask
    again later). Nothing goes to the GPU here."""
    state = raw_request.app.state
    models = state.openai_serving_models
    catalog = serving.catalog_of(models)
    served = models.lora_requests.get(name)  # an alias serves a version's entry
    entry = catalog.entries.get(served.lora_name if served is not None else name)
    if entry is None:
        return _error_json(404, "NotFoundError", f"unknown LoRA adapter '{name}'")
    if entry.error is not None or served is None:
        return _error_json(400, errors.ADAPTER_INVALID, serving.bad_adapter_message(
            name, entry.error or "it is not served"))
    if cli_args.active_config().pool != "paged":
        return _error_json(400, "BadRequestError", "prefetch needs the paged pool "
                           "(this server runs --loraserve-pool vllm)")
    try:
        answers = await state.engine_client.collective_rpc(
            "loraserve_prefetch", args=(served.lora_name, served.lora_int_id,
                                        served.lora_path, entry.spec.size_bytes))
    except Exception as e:
        return _engine_unavailable(e)
    states = {a["state"] for a in answers}
    failed = [a["reason"] for a in answers if a["state"] == "failed"]
    sticky = [r for r in failed if not r.endswith(TRANSIENT_NOTE)]
    if sticky:  # as a request's failure would, its next requests get 400 at once
        if catalog.entries.get(entry.name) is entry:  # not unloaded or reloaded meanwhile
            catalog.reject(entry.name, sticky[0])
        return _error_json(400, errors.ADAPTER_INVALID,
                           serving.bad_adapter_message(name, sticky[0]))
    if failed:  # an I/O error, say: not the adapter's; the next ask reads again
        return _error_json(503, errors.ADAPTER_UNCHECKED,
                           serving.bad_adapter_message(name, failed[0]))
    if "no-room" in states:
        return _error_json(409, errors.HOST_TIER_FULL, f"LoRA adapter '{name}' not "
                           "prefetched: the host tier has no room beside the adapters it "
                           "keeps (those waiting requests need, and those read since the "
                           "engine's last step)")
    host = states == {"host"}
    return JSONResponse(status_code=200 if host else 202,
                        content={"name": name, "state": "host" if host else "reading"})


class LoraServeEndpoint:
    """The `EndpointPlugin` (vllm/plugins/endpoint_plugins/interface.py)."""

    name = cli_args.PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        if cli_args.active_config() is None:
            logger.warning("loraserve endpoint plugin loaded, but the plugin is not active "
                           "for this server (add --plugin loraserve); no routes added")
            return
        serving.install()
        _guard_with_api_key()
        app.include_router(router)

        # vLLM serves /metrics without the API key; the refresh follows it.
        @app.middleware("http")
        async def refresh_before_metrics(request: Request, call_next):
            if request.url.path.rstrip("/") == "/metrics":
                try:
                    await _refresh(request.app.state)
                except Exception as e:  # stale adapter metrics beat a failed scrape
                    logger.warning("adapter metrics not refreshed: %s", e)
            return await call_next(request)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if cli_args.active_config() is not None and engine_client is None:
            raise RuntimeError("vllm-loraserve needs an engine (not the render-only server)")


def install_gate() -> None:
    """Let an active plugin attach its endpoint without VLLM_PLUGINS."""
    import vllm.envs as envs
    import vllm.plugins

    def make(load_endpoint_plugins):
        def patched(supported_tasks=None):
            if cli_args.active_config() is None:
                return load_endpoint_plugins(supported_tasks)
            # Unset VLLM_PLUGINS loads no endpoint plugin (and warns that it
            # would need one): --plugin loraserve is our allowlist entry.
            plugins = [] if envs.VLLM_PLUGINS is None else load_endpoint_plugins(supported_tasks)
            if not any(p.name == LoraServeEndpoint.name for p in plugins):
                plugins.append(LoraServeEndpoint())
            return plugins

        return patched

    wrap(vllm.plugins, "load_endpoint_plugins", make)
