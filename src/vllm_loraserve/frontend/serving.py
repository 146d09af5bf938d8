"""API-server patches on vLLM's adapter registry (`OpenAIServingModels`,
vllm/entrypoints/openai/models/serving.py) and model check (`BaseServing.
_check_model`, vllm/entrypoints/serve/engine/serving.py).

With the plugin active:
- every adapter is inspected and checked against the model before vLLM sees
  it (`AdapterCatalog.inspect`); a bad one is refused with HTTP 400 and a
  reason instead of failing start-up (static `--lora-modules`) or the engine
  step; its tensors are checked once for NaN/Inf and for a scaling that
  overflows the serving dtype: with the paged pool by the worker that reads
  them (a runtime or `--lora-modules` load's add_lora fails, and gets the
  400; a directory adapter's first request fails, `note_engine_failure`),
  with `--loraserve-pool vllm` here (directory adapters: on their first
  request);
- names must be safe identifiers, neither they nor their alias a served
  model's name, and a plain name must not be the alias of served versions
  (400; the alias rule in adapters/safety.py), and a runtime
  `/v1/load_lora_adapter` path, and every file in it, must lie inside the
  adapter roots (`--loraserve-adapter-dir`, `--loraserve-allowed-root`),
  else 403 (adapters/safety.py); an adapter directory's adapters likewise,
  inside the adapter directories, else they are listed invalid;
- loads, reloads and unloads of one version line run one at a time
  (`AdapterCatalog.line_locks`), so `lora_requests`, the catalogue and the
  worker's copies agree whatever order concurrent calls arrive in;
- `--loraserve-adapter-dir` adapters are registered by name without loading:
  the worker reads each from disk on its first request;
- requests naming an invalid adapter get HTTP 400 with the reason; unknown
  names keep vLLM's 404;
- a duplicate load vLLM refuses, or a refused runtime load, leaves the
  catalogue as it was;
- an adapter the engine could not serve after all (weights its worker
  refused as it read them, or files changed on disk after the checks) is
  marked invalid with the engine's reason when its first request fails, and
  that request's error names it (`note_engine_failure`); a transient
  failure (an I/O error, memory that ran out) fails its requests alone;
- `/v1/unload_lora_adapter` also frees the worker's copy (vLLM alone only
  forgets the name);
- loading a versioned name `name@version` (vllm_loraserve.train publishes
  them) moves the alias `name` to it, unless `name` is an adapter of its own
  (then the alias follows when that one is unloaded). An adapter directory's
  versions are loaded at start-up oldest first (`version_order`, as the
  router orders its catalogue), so the alias names the newest.
  The alias is one more key of vLLM's `lora_requests` for the same
  LoRARequest, resolved once per request at admission
  (`_maybe_get_adapters`): a request in flight keeps the version it started
  with, later ones get the new one. Unloading the version the alias points
  to (or the plain adapter) moves it to the newest version left, or removes
  it. `/v1/models` lists
  the alias under its own name (vLLM would list the version twice), and
  only adapters that can be served.
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from http import HTTPStatus
from typing import Any

from vllm_loraserve._patching import wrap
from vllm_loraserve.adapters.directory import invalid_lines, scan_adapter_dir
from vllm_loraserve.adapters.peft import ModelLoRAInfo
from vllm_loraserve.adapters.safety import (
    PathOutsideRoots,
    alias_of,
    check_name,
    check_not_alias,
    newest_version,
    resolve_adapter_under_roots,
    version_order,
)
from vllm_loraserve.config import from_vllm_config
from vllm_loraserve.frontend import errors
from vllm_loraserve.frontend.catalog import AdapterCatalog, AdapterEntry, WeightsUnchecked
from vllm_loraserve.paging.step import TRANSIENT_NOTE

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format

CATALOG_ATTR = "_loraserve_catalog"
# This API-server process's catalogues (one per served model registry).
_CATALOGS: weakref.WeakSet[AdapterCatalog] = weakref.WeakSet()


def catalog_of(models: Any) -> AdapterCatalog | None:
    return getattr(models, CATALOG_ATTR, None)


def bad_adapter_message(name: str, reason: str) -> str:
    return f"LoRA adapter '{name}' cannot be served: {reason}"


def _error(message: str, err_type: str, status: HTTPStatus, param: str = "model") -> Any:
    from vllm.entrypoints.serve.utils.error_response import create_error_response

    return create_error_response(message=message, err_type=err_type, status_code=status,
                                 param=param)


def _bad_adapter(name: str, reason: str) -> Any:
    return _error(bad_adapter_message(name, reason), errors.ADAPTER_INVALID,
                  HTTPStatus.BAD_REQUEST)


def _reserved_names(models: Any) -> set[str]:
    return {p.name for p in models.base_model_paths}


def _make_catalog(models: Any) -> AdapterCatalog:
    import torch

    engine_client = models.engine_client

    async def fetch() -> ModelLoRAInfo:
        raw = (await engine_client.collective_rpc("loraserve_lora_modules"))[0]
        return ModelLoRAInfo.from_wire(raw, engine_client.vllm_config.lora_config.max_lora_rank)

    # The dtype vLLM holds B * scaling in (VllmConfig resolved "auto" to the
    # model's dtype: LoRAConfig.verify_with_model_config). The paged pool's
    # workers check the tensors as they read them (worker/paged_manager.py
    # `_read_file`): this process reads none then.
    vllm_config = engine_client.vllm_config
    paged = from_vllm_config(vllm_config).pool == "paged"
    catalog = AdapterCatalog(
        fetch, None if paged else torch.finfo(vllm_config.lora_config.lora_dtype).max)
    _CATALOGS.add(catalog)
    return catalog


def note_engine_failure(req_state: Any, reason: str) -> None:
    """The engine failed this request (an output processor `RequestState`)
    because its adapter cannot be served. Mark the adapter invalid here too,
    so its next requests get HTTP 400 at once, unless the failure was
    transient (an I/O error, memory that ran out: paging/step.py
    `TRANSIENT_NOTE`; the next request loads it again), and end the request
    with that error: a client error passes through vLLM's `generate` to the
    serving layer, streamed or not, where a finish reason "error" before the
    first token would be skipped (streamed) or say only "Internal server
    error" (as would a server error, even a 503: `generate` lets only client
    errors through, so a transient failure is a 400 too, its message says
    to retry)."""
    from vllm.exceptions import VLLMValidationError

    name = req_state.lora_name
    for catalog in () if reason.endswith(TRANSIENT_NOTE) else _CATALOGS:
        entry = catalog.entries.get(name)
        if entry is not None and entry.spec is not None:
            logger.error("%s (other adapters keep serving)", bad_adapter_message(name, reason))
            catalog.reject(name, reason)
    if req_state.queue is not None:  # AsyncLLM; the offline LLM returns the output
        req_state.queue.put(VLLMValidationError(bad_adapter_message(name, reason),
                                                parameter="model"))


# How vLLM wraps a worker's add_lora error on its way to the API server:
# EngineCoreProc._invoke_utility_method, then (multiprocess executor)
# MultiprocExecutor.collective_rpc, whose "stack trace above" is the server's log.
_UTILITY_PREFIX = "Call to add_lora method failed: "
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace "
                           r"above for the root cause", re.DOTALL)


def _worker_reason(message: str) -> str:
    """The worker's own reason for refusing an adapter (e.g. NaN weights its
    read found) out of vLLM's wrapping; the message as it is if vLLM wraps
    it some other way."""
    message = message.removeprefix(_UTILITY_PREFIX)
    inner = _WORKER_ERROR.fullmatch(message)
    return inner.group(1) if inner else message


def _make_load_lora_adapter(load_lora_adapter):
    async def patched(self, request, base_model_name=None, *, loraserve_source="runtime"):
        catalog = catalog_of(self)
        name = request.lora_name
        if catalog is None or not request.lora_path:
            return await load_lora_adapter(self, request, base_model_name)
        try:
            check_name(name, _reserved_names(self))
        except ValueError as e:
            return _refused_name(e)
        async with catalog.line_locks.hold(alias_of(name)):
            return await _load(self, catalog, load_lora_adapter, request, base_model_name,
                               loraserve_source)

    return patched


def _refused_name(e: ValueError) -> Any:
    return _error(f"LoRA adapter refused: {e}", "BadRequestError", HTTPStatus.BAD_REQUEST,
                  "lora_name")


async def _load(models: Any, catalog: AdapterCatalog, load_lora_adapter, request,
                base_model_name, source: str) -> Any:
    """The load of a checked name, under its line's lock."""
    from vllm.entrypoints.openai.engine.protocol import ErrorResponse

    name = request.lora_name
    served = models.lora_requests.get(name)
    try:
        check_not_alias(name, None if served is None else served.lora_name)
    except ValueError as e:
        return _refused_name(e)
    if source == "runtime":
        # Paths from the network: only inside the configured roots.
        cfg = from_vllm_config(models.engine_client.vllm_config)
        try:
            resolve_adapter_under_roots(request.lora_path,
                                        [*cfg.adapter_dirs, *cfg.allowed_roots])
        except PathOutsideRoots as e:
            return _error(f"LoRA adapter '{name}' refused: {e}", "PermissionDenied",
                          HTTPStatus.FORBIDDEN, "lora_path")
        except ValueError as e:  # a NUL byte or a lone surrogate: no path the OS takes
            return _error(f"LoRA adapter '{name}' refused: invalid lora_path "
                          f"{request.lora_path!r}: {e}", "BadRequestError",
                          HTTPStatus.BAD_REQUEST, "lora_path")
    if served is not None and not request.load_inplace:
        # vLLM refuses the duplicate (its message, our type); the served
        # version's entry stays as it is.
        result = await load_lora_adapter(models, request, base_model_name)
        if isinstance(result, ErrorResponse):
            return _error(result.error.message, errors.ADAPTER_LOADED,
                          HTTPStatus.BAD_REQUEST, "lora_name")
        return result
    entry = await catalog.inspect(name, request.lora_path, source, read_weights=True)
    keep_invalid = source != "runtime"  # configured ones stay listed
    if entry.error is not None:
        if keep_invalid:
            catalog.record(entry)
        return _bad_adapter(name, entry.error)
    result = await load_lora_adapter(models, request, base_model_name)
    if isinstance(result, ErrorResponse):
        reason = _worker_reason(result.error.message)
        if getattr(models.engine_client, "errored", False):  # not the adapter's fault
            return _error(f"LoRA adapter '{name}' could not be loaded: the engine is not "
                          f"running ({reason})", errors.ENGINE_UNAVAILABLE,
                          HTTPStatus.SERVICE_UNAVAILABLE)
        if keep_invalid and name not in models.lora_requests:
            entry.spec, entry.error = None, reason
            catalog.record(entry)
        return _bad_adapter(name, reason)
    catalog.record(entry)
    catalog.bind(name, models.lora_requests[name].lora_int_id)
    _point_alias(models, catalog, name)
    return result


def _point_alias(models: Any, catalog: AdapterCatalog, name: str) -> None:
    """A version `name@v` just served becomes what its alias `name` serves,
    unless a plain adapter `name` is served (the alias rule)."""
    alias = alias_of(name)
    if alias != name and alias not in catalog.entries:
        models.lora_requests[alias] = models.lora_requests[name]
        logger.info("LoRA alias '%s' now serves '%s'", alias, name)


def _repoint_alias(models: Any, catalog: AdapterCatalog, unloaded: str) -> None:
    """After `unloaded` is gone: if it was what its line's name served (the
    version the alias pointed to, or the plain adapter), the alias moves to
    the newest (last loaded) version left, or is removed."""
    alias = alias_of(unloaded)
    current = models.lora_requests.get(alias)
    if alias in catalog.entries:
        return  # a plain adapter of that name keeps it
    if alias != unloaded and (current is None or current.lora_name != unloaded):
        return  # the alias serves another version, or was removed on request
    by_load = sorted(models.lora_requests, key=lambda n: models.lora_requests[n].lora_int_id)
    newest = newest_version(alias, by_load)
    if newest is not None:
        models.lora_requests[alias] = models.lora_requests[newest]
    else:
        models.lora_requests.pop(alias, None)


def _make_init_static_loras(init_static_loras):
    async def patched(self):
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
        from vllm.lora.request import LoRARequest

        cfg = from_vllm_config(self.engine_client.vllm_config)
        if cfg is None:
            return await init_static_loras(self)
        catalog = _make_catalog(self)
        setattr(self, CATALOG_ATTR, catalog)
        for lora in self.static_lora_modules or []:
            request = LoadLoRAAdapterRequest(lora_name=lora.name, lora_path=lora.path,
                                             is_3d_lora_weight=lora.is_3d_lora_weight)
            result = await self.load_lora_adapter(request, lora.base_model_name,
                                                  loraserve_source="lora-modules")
            # One the catalogue lists invalid is logged with the others below.
            if isinstance(result, ErrorResponse) and catalog.invalid_reason(lora.name) is None:
                logger.error("%s (other adapters keep serving)", result.error.message)
        reserved = _reserved_names(self)
        for root in cfg.adapter_dirs:
            # Oldest version first, as if published in order: ids grow with
            # versions, so each alias ends on its line's newest.
            for name, path in sorted(scan_adapter_dir(root), key=lambda e: version_order(e[0])):
                try:
                    check_name(name, reserved)
                except ValueError as e:
                    logger.error("%s in %s is not served: %s", path, root, e)
                    continue
                if name in catalog.entries:
                    logger.warning("adapter name '%s' in %s is already taken by %s; skipped",
                                   name, root, catalog.entries[name].path)
                    continue
                try:  # the roots a runtime load may read: a symlinked adapter may point there
                    resolve_adapter_under_roots(path, [*cfg.adapter_dirs, *cfg.allowed_roots])
                except PathOutsideRoots as e:
                    catalog.record(AdapterEntry(name, os.path.abspath(path), "adapter-dir",
                                                error=str(e)))
                    continue
                entry = await catalog.admit(name, path, "adapter-dir")
                if entry.error is not None:
                    continue
                lora_int_id = self.lora_id_counter.inc(1)
                self.lora_requests[name] = LoRARequest(
                    lora_name=name, lora_int_id=lora_int_id, lora_path=entry.path)
                catalog.bind(name, lora_int_id)
                _point_alias(self, catalog, name)
        invalid = {n: e.error for n, e in catalog.entries.items() if e.error is not None}
        logger.info("vllm-loraserve catalogue: %d adapters ready, %d invalid",
                    len(catalog.entries) - len(invalid), len(invalid))
        for line in invalid_lines(invalid):
            logger.error("%s", line)

    return patched


def _make_unload_lora_adapter(unload_lora_adapter):
    async def patched(self, request):
        catalog = catalog_of(self)
        if catalog is None or not isinstance(request.lora_name, str):
            return await unload_lora_adapter(self, request)
        async with catalog.line_locks.hold(alias_of(request.lora_name)):
            return await _unload(self, catalog, unload_lora_adapter, request)

    return patched


async def _unload(models: Any, catalog: AdapterCatalog, unload_lora_adapter, request) -> Any:
    """The unload of a name, under its line's lock."""
    from vllm.entrypoints.openai.engine.protocol import ErrorResponse

    name = request.lora_name
    served = models.lora_requests.get(name)
    if served is None and catalog.invalid_reason(name) is not None:
        catalog.forget(name)
        _repoint_alias(models, catalog, name)
        return f"Success: invalid LoRA adapter '{name}' removed."
    if served is not None and served.lora_name != name:  # an alias: its version stays
        del models.lora_requests[name]
        return f"Success: LoRA alias '{name}' removed."
    result = await unload_lora_adapter(models, request)
    if not isinstance(result, ErrorResponse):
        catalog.forget(name)
        _repoint_alias(models, catalog, name)
        await models.engine_client.remove_lora(served.lora_int_id)
    return result


def _make_show_available_models(show_available_models):
    async def patched(self):
        models = await show_available_models(self)
        if catalog_of(self) is None:
            return models
        # vLLM makes one card per lora_requests value, named by the request:
        # an alias shares its version's request. One card per key instead,
        # and none for an adapter the engine failed (`note_engine_failure`:
        # it stays registered, so that its unload clears the worker, but
        # cannot be served).
        catalog = catalog_of(self)
        loras = {r.lora_name for r in self.lora_requests.values()}
        template = {c.id: c for c in models.data if c.id in loras}
        models.data = [c for c in models.data if c.id not in loras] + [
            template[r.lora_name].model_copy(update={"id": name})
            for name, r in self.lora_requests.items()
            if r.lora_name in template and catalog.invalid_reason(r.lora_name) is None]
        return models

    return patched


def _make_check_model(check_model):
    async def patched(self, request):
        catalog = catalog_of(self.models)
        name = getattr(request, "model", None)
        if catalog is not None and name in catalog.entries:
            failed_before = catalog.invalid_reason(name) is not None
            try:
                reason = await catalog.check_weights(name)
            except WeightsUnchecked as e:
                return _error(f"LoRA adapter '{name}' cannot be checked now: {e}",
                              errors.ADAPTER_UNCHECKED, HTTPStatus.SERVICE_UNAVAILABLE)
            if reason is not None:
                # Only an adapter the engine never loaded can fail its check
                # here (`--loraserve-pool vllm`: a directory adapter on its
                # first request): vLLM forgets it too. One the engine failed (`note_engine_failure`)
                # stays registered, so unloading it also clears the worker.
                if not failed_before and self.models.lora_requests.get(name) is not None and \
                        catalog.entries[name].source == "adapter-dir":
                    del self.models.lora_requests[name]
                return _bad_adapter(name, reason)
        return await check_model(self, request)

    return patched


def install() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing

    wrap(OpenAIServingModels, "load_lora_adapter", _make_load_lora_adapter)
    wrap(OpenAIServingModels, "init_static_loras", _make_init_static_loras)
    wrap(OpenAIServingModels, "unload_lora_adapter", _make_unload_lora_adapter)
    wrap(OpenAIServingModels, "show_available_models", _make_show_available_models)
    wrap(BaseServing, "_check_model", _make_check_model)
