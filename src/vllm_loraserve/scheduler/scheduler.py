"""The engine-core side of the unified pool: vLLM's scheduler, made page-aware.

`make_scheduler` is what `--scheduler-cls` names when the pool is on
(frontend/args.py sets it). It returns vLLM's own Scheduler (or
AsyncScheduler) with `PoolSchedulerMixin` in front, which changes four
things:

- **No slot cap.** vLLM skips a waiting request once `max_loras` distinct
  adapters are scheduled; the mixin lifts that cap. Pages are the only limit.
- **One admission decision for adapter pages and KV.** `allocate_slots`
  (vLLM's single admission point for running, resumed and waiting requests)
  first makes the request's adapter resident, then asks for KV blocks; while
  KV does not fit it evicts idle adapters (LRU) and retries. vLLM preempts a
  request only when `allocate_slots` returns None, so idle adapters always
  go before any request's KV (S-LoRA §5.2).
- **Refs follow requests.** A request holds its adapter from admission until
  `_free_request_blocks` (finish and preemption alike).
- **Workers hear of every page change** through `PoolStep` on the step's
  SchedulerOutput (paging/step.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from vllm_loraserve._patching import overlay, wrap
from vllm_loraserve.adapters.peft import (
    AdapterError,
    ModelLoRAInfo,
    check_against_model,
    inspect_adapter,
)
from vllm_loraserve.config import from_vllm_config
from vllm_loraserve.paging.layout import LayerLayout
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.paging.step import STEP_ATTR
from vllm_loraserve.scheduler.pages import AdapterPages

logger = logging.getLogger(f"vllm.{__name__}")
# Distinct adapters ahead in the waiting queue whose host copies are prepared:
# enough to hide disk reads behind the steps, few enough not to churn a host
# tier that holds only tens of large adapters.
PREFETCH_AHEAD = 16


def page_elements(vllm_config: Any, kv_cache_config: Any) -> int:
    """Adapter elements per KV page; refuses KV layouts the pool cannot share."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("the loraserve pool needs one full-attention KV cache group; this "
                         "model has " + ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
                         + " (use --loraserve-pool vllm)")
    spec = groups[0].kv_cache_spec
    dtype = vllm_config.lora_config.lora_dtype
    if spec.dtype != dtype or spec.page_size_padded is not None:
        raise ValueError(f"the loraserve pool stores adapters in KV pages of the adapters' "
                         f"dtype: KV cache is {spec.dtype}, adapters {dtype} "
                         "(use --loraserve-pool vllm)")
    return spec.page_size_bytes // dtype.itemsize


def pool_layout(vllm_config: Any, page_size: int) -> LayerLayout:
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        raise ValueError("the loraserve pool supports tensor_parallel_size 1 for now "
                         "(use --loraserve-pool vllm)")
    return model_layout(vllm_config.model_config.hf_text_config, page_size)


class PoolSchedulerMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = from_vllm_config(self.vllm_config)
        layout = pool_layout(self.vllm_config, page_elements(self.vllm_config,
                                                              self.kv_cache_config))

        demands: dict[int, tuple[int, int]] = {}  # lora id -> (rank, pages)
        # The API server's adapter check, against what the pool can serve.
        servable = ModelLoRAInfo({s.name: frozenset({(s.in_features, s.out_features)})
                                  for s in layout.slices}, self.lora_config.max_lora_rank)
        max_pages = self.kv_cache_manager.block_pool.num_gpu_blocks - 1

        def demand(lora_request: Any) -> tuple[int, int]:
            key = lora_request.lora_int_id
            if key not in demands:
                spec = inspect_adapter(lora_request.lora_path)
                check_against_model(spec, servable)
                pages = layout.place(spec.rank, spec.target_modules).num_pages
                if pages > max_pages:
                    raise AdapterError(f"it needs {pages} pages, more than the whole KV "
                                       "cache holds")
                demands[key] = spec.rank, pages
            return demands[key]

        self._adapter_demands = demands
        self._hinted: set[int] = set()
        self._adapter_failures: dict[str, str] = {}  # request id -> why
        # The scheduler reads max_loras only to cap distinct adapters per batch.
        self.lora_config = overlay(self.lora_config, max_loras=sys.maxsize)
        self.adapter_pages = AdapterPages(self.kv_cache_manager.block_pool, demand,
                                          cfg.max_slots)
        self.kv_cache_manager.allocate_slots = self._make_allocate(
            self.kv_cache_manager.allocate_slots)
        logger.info("vllm-loraserve pool: adapters share %d KV pages of %d elements",
                    self.kv_cache_manager.block_pool.num_gpu_blocks - 1, layout.page_size)

    def _make_allocate(self, allocate_slots: Any) -> Any:
        pages = self.adapter_pages

        def allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
            lr = request.lora_request
            acquired = False
            if lr is not None and not pages.holds(request.request_id):
                if request.request_id in self._adapter_failures:
                    return None
                try:
                    if not pages.acquire(request.request_id, lr):
                        return None
                except AdapterError as e:
                    # Only this request fails (update_from_output), not the engine.
                    reason = f"adapter {lr.lora_name} cannot be served: {e}"
                    logger.error("vllm-loraserve: %s", reason)
                    self._adapter_failures[request.request_id] = reason
                    return None
                acquired = True
            blocks = allocate_slots(request, *args, **kwargs)
            # Idle adapters go before any request's KV: vLLM preempts only on None.
            keep = lr.lora_int_id if lr is not None else None
            while blocks is None and pages.evictable_pages(keep) and pages.evict_lru():
                blocks = allocate_slots(request, *args, **kwargs)
            if blocks is None and acquired:
                pages.release(request.request_id)
            return blocks

        return allocate

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        step = self.adapter_pages.take_step()
        step.prefetch = self._prefetch_hints()
        setattr(out, STEP_ATTR, step)
        return out

    def _prefetch_hints(self) -> list[Any]:
        """The next PREFETCH_AHEAD distinct cold adapters in the waiting queue,
        each hinted once until it becomes resident (S-LoRA §5.2)."""
        hints, seen = [], set()
        for request in self.waiting:
            lr = request.lora_request
            if lr is None or lr.lora_int_id in seen:
                continue
            seen.add(lr.lora_int_id)
            if len(seen) > PREFETCH_AHEAD:
                break
            if lr.lora_int_id not in self.adapter_pages.resident and \
                    lr.lora_int_id not in self._hinted:
                self._hinted.add(lr.lora_int_id)
                hints.append(lr)
        self._hinted &= seen  # hint again once it left the window and came back
        return hints

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        if self._adapter_failures:
            from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
            from vllm.v1.request import RequestStatus

            failed = self.finish_requests(list(self._adapter_failures),
                                          RequestStatus.FINISHED_ERROR)
            self._adapter_failures.clear()
            for request in failed:
                eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
                eco.outputs.append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[],
                    finish_reason=request.get_finished_reason(), events=request.take_events(),
                    trace_headers=request.trace_headers))
        return outputs

    def _free_request_blocks(self, request: Any) -> None:
        super()._free_request_blocks(request)
        self.adapter_pages.release(request.request_id)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # BlockPool.reset_prefix_cache needs every block free: idle adapters go.
        self.adapter_pages.evict_all_idle()
        return super().reset_prefix_cache(*args, **kwargs)

    def forget_adapter(self, lora_id: int) -> None:
        """A runtime remove or in-place reload: drop the adapter's pages once idle."""
        self.adapter_pages.forget(lora_id)
        self._adapter_demands.pop(lora_id, None)


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """`--scheduler-cls` target: vLLM's scheduler class for this config, with
    the pool mixin in front. EngineCore calls it like a class."""
    vllm_config = kwargs["vllm_config"]
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    cls = _POOL_CLASSES.get(base)
    if cls is None:
        cls = _POOL_CLASSES[base] = type(f"LoraServe{base.__name__}",
                                         (PoolSchedulerMixin, base), {})
    return cls(*args, **kwargs)


_POOL_CLASSES: dict[type, type] = {}


def _make_remove_lora(remove_lora: Any) -> Any:
    def patched(self: Any, lora_id: int) -> bool:
        if isinstance(self.scheduler, PoolSchedulerMixin):
            self.scheduler.forget_adapter(lora_id)
        return remove_lora(self, lora_id)

    return patched


def _make_add_lora(add_lora: Any) -> Any:
    def patched(self: Any, lora_request: Any) -> bool:
        if lora_request.load_inplace and isinstance(self.scheduler, PoolSchedulerMixin):
            self.scheduler.forget_adapter(lora_request.lora_int_id)
        return add_lora(self, lora_request)

    return patched


def install() -> None:
    """EngineCore's LoRA RPCs bypass the scheduler (they go straight to the
    workers); a remove or an in-place reload must also drop the pages."""
    from vllm.v1.engine.core import EngineCore

    wrap(EngineCore, "remove_lora", _make_remove_lora)
    wrap(EngineCore, "add_lora", _make_add_lora)
