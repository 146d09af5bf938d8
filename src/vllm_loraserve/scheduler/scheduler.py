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
- **Admission waits for the host tier, not the batch.** A waiting request
  whose adapter is neither resident nor in the workers' host tier (their
  `PoolReport`) is set aside for the step; its adapter is among the next
  cold adapters of the queue the workers read in the background (S-LoRA's
  prefetch), and requests behind it whose adapters are ready go first.
- **An adapter that cannot be served fails its own requests**, whether the
  check fails here or the worker cannot read its files later; the engine
  keeps serving everyone else. A worker's failure is sticky until the
  adapter is removed or reloaded, unless the worker reports it transient
  (an I/O error, memory that ran out): then the requests of that moment
  fail, and a later request loads the adapter again.
- **Workers hear of every page change** through `PoolStep` on the step's
  SchedulerOutput (paging/step.py).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
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
from vllm_loraserve.paging.step import REPORT_ATTR, STEP_ATTR, PoolReport, Prefetch
from vllm_loraserve.scheduler.pages import AdapterPages
from vllm_loraserve.scheduler.waits import AdapterWaits

logger = logging.getLogger(f"vllm.{__name__}")
# Distinct cold adapters of the waiting queue whose host copies are prepared
# at once: enough to keep the readers busy and hide disk reads behind the
# steps, few enough not to churn a host tier that holds only tens of large
# adapters.
PREFETCH_AHEAD = 16
# Adapters loaded into pages per step for waiting requests (their host copy
# ready), and the share of KV blocks those loads leave free: the workers
# copy them beside the step's forward pass, and KV growth of the running
# requests keeps its room (an idle adapter is evicted before any KV is
# refused anyway, but its copy is then wasted).
LOAD_AHEAD = 4
LOAD_AHEAD_FREE = 0.10


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
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        # Pages and host-tier reports are per worker; only one worker's
        # report reaches the scheduler.
        raise ValueError("the loraserve pool supports tensor_parallel_size and "
                         "pipeline_parallel_size 1 for now (use --loraserve-pool vllm)")
    if getattr(parallel, "use_ubatching", False):
        # Micro-batches run on two streams, interleaved; the pool's layers
        # share one step's token batches and h buffers.
        raise ValueError("the loraserve pool does not support micro-batching (--enable-dbo, "
                         "ubatch_size > 1) (use --loraserve-pool vllm)")
    return model_layout(vllm_config.model_config.hf_text_config, page_size)


def take_out(queue: Any, requests: list[Any], policy: Any) -> Any:
    """Remove `requests` (in queue order) from a vLLM request queue; returns
    them as a queue that `queue.prepend_requests` puts back in that order
    (it takes its argument back to front, as vLLM's own skipped queue is
    built)."""
    from vllm.v1.core.sched.request_queue import create_request_queue

    queue.remove_requests(requests)
    aside = create_request_queue(policy)
    for request in requests:
        aside.prepend_request(request)
    return aside


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
        self._demand = demand
        self._adapter_failures: dict[str, str] = {}  # request id -> why
        # The workers' host tier, from their last PoolReport.
        self._host_ready: frozenset[int] = frozenset()
        # lora id -> why (sticky until removed; transient ones are never here)
        self._read_failures: dict[int, str] = {}
        self._adapter_waits = AdapterWaits()
        self._waits: list[float] = []  # adapter waits of this step's admissions
        # The scheduler reads max_loras only to cap distinct adapters per batch.
        self.lora_config = overlay(self.lora_config, max_loras=sys.maxsize)
        self.adapter_pages = AdapterPages(self.kv_cache_manager.block_pool, demand,
                                          cfg.max_slots)
        self.kv_cache_manager.allocate_slots = self._make_allocate(
            self.kv_cache_manager.allocate_slots)
        self.kv_cache_manager.reset_prefix_cache = self._make_reset(
            self.kv_cache_manager.reset_prefix_cache)
        logger.info("vllm-loraserve pool: adapters share %d KV pages of %d elements",
                    self.kv_cache_manager.block_pool.num_gpu_blocks - 1, layout.page_size)

    def _make_allocate(self, allocate_slots: Any) -> Any:
        pages = self.adapter_pages
        signature = inspect.signature(allocate_slots)

        def prefix_hits(request: Any, args: Any, kwargs: Any) -> list[Any]:
            hits = signature.bind(request, *args, **kwargs).arguments.get("new_computed_blocks")
            return [b for group in hits.blocks for b in group] if hits is not None else []

        def allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
            lr = request.lora_request
            acquired = False
            if lr is not None and not pages.holds(request.request_id):
                if request.request_id in self._adapter_failures:
                    return None
                try:
                    if not pages.acquire(request.request_id, lr,
                                         prefix_hits(request, args, kwargs)):
                        return None
                except AdapterError as e:
                    # Only this request fails (update_from_output), not the engine.
                    self._fail_request(request, str(e))
                    return None
                acquired = True
            blocks = allocate_slots(request, *args, **kwargs)
            # Idle adapters go before any request's KV: vLLM preempts only on None.
            keep = lr.lora_int_id if lr is not None else None
            while blocks is None and pages.evictable_pages(keep) and pages.evict_lru():
                blocks = allocate_slots(request, *args, **kwargs)
            if blocks is None and acquired:
                pages.release(request.request_id)
            elif acquired:
                self._waits.append(self._adapter_waits.admitted(request.request_id,
                                                                time.monotonic()))
            return blocks

        return allocate

    def _make_reset(self, reset_prefix_cache: Any) -> Any:
        def reset() -> bool:
            # It needs every block free: idle adapters go. Here, not before vLLM's
            # reset_running_requests preempts the running ones, releasing theirs.
            self.adapter_pages.evict_all_idle()
            return reset_prefix_cache()

        return reset

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held = self._set_aside_cold()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            for queue, requests in held:
                queue.prepend_requests(requests)
        self._load_ahead()
        step = self.adapter_pages.take_step()
        step.prefetch, step.keep = self._host_plan()
        step.waits, self._waits = self._waits, []
        setattr(out, STEP_ATTR, step)
        return out

    def _ready(self, lora_id: int) -> bool:
        if self.adapter_pages.replaced_in_use(lora_id):
            return False  # its requests wait aside for the new version
        return lora_id in self.adapter_pages.resident or lora_id in self._host_ready

    def _set_aside_cold(self) -> list[tuple[Any, Any]]:
        """Take waiting requests whose adapter is not ready out of vLLM's
        queues for this step (vLLM stops at the first request it cannot
        admit; these must not block the ones behind them)."""
        now, held = time.monotonic(), []
        for queue in (self.waiting, self.skipped_waiting):
            cold = []
            for r in queue:
                if r.lora_request is None:
                    continue
                reason = self._read_failures.get(r.lora_request.lora_int_id)
                if reason is not None:
                    self._fail_request(r, reason)
                if r.request_id in self._adapter_failures or \
                        not self._ready(r.lora_request.lora_int_id):
                    cold.append(r)
                else:
                    self._adapter_waits.ready(r.request_id, now)
            if not cold:
                continue
            for request in cold:
                self._adapter_waits.held(request.request_id, now)
            held.append((queue, take_out(queue, cold, self.policy)))
        return held

    def _load_ahead(self) -> None:
        """S-LoRA's prefetch into pages: after the step's admissions, the
        first LOAD_AHEAD waiting adapters in the host tier but not resident
        are loaded into free pages (never evicting; at least LOAD_AHEAD_FREE
        of the blocks stay free), so the workers copy them beside this step
        and their requests' admission finds them resident."""
        pool = self.kv_cache_manager.block_pool
        reserve = int(LOAD_AHEAD_FREE * pool.num_gpu_blocks)
        if pool.get_num_free_blocks() <= reserve:
            return  # no adapter fits (each needs a block): skip the scan of the queue
        loaded, seen = 0, set()
        for queue in (self.skipped_waiting, self.waiting):
            for request in queue:
                lr = request.lora_request
                if loaded >= LOAD_AHEAD:
                    return
                if lr is None or lr.lora_int_id in seen or \
                        lr.lora_int_id not in self._host_ready or \
                        request.request_id in self._adapter_failures or \
                        self.adapter_pages.removed(lr.lora_int_id):
                    continue  # a removed one: only its admission loads it (pages.py)
                seen.add(lr.lora_int_id)
                try:
                    if self.adapter_pages.load_ahead(lr, reserve):
                        loaded += 1
                    elif lr.lora_int_id not in self.adapter_pages.resident:
                        return  # no room: later adapters do not take pages before this one
                except AdapterError:
                    continue  # its admission fails it, with the reason

    def _host_plan(self) -> tuple[list[Prefetch], list[int]]:
        """What the workers' host tier should hold for the waiting queue:
        the first PREFETCH_AHEAD distinct adapters that are not ready, to
        read (S-LoRA §5.2; hinted every step until ready: the workers skip
        reads done or under way, and reads the tier has no room for yet),
        and the host-ready adapters the pool does not hold, to keep."""
        hints, keep, seen = [], [], set()
        for queue in (self.skipped_waiting, self.waiting):
            for request in queue:
                lr = request.lora_request
                if lr is None or lr.lora_int_id in seen:
                    continue
                seen.add(lr.lora_int_id)
                if lr.lora_int_id in self.adapter_pages.resident or \
                        lr.lora_int_id in self._read_failures:
                    continue
                if lr.lora_int_id in self._host_ready:
                    keep.append(lr.lora_int_id)
                elif len(hints) < PREFETCH_AHEAD:
                    try:
                        pages = self._demand(lr)[1]
                    except AdapterError:
                        pages = 0  # the worker's read reports why
                    hints.append(Prefetch(lr, pages))
        return hints, keep

    def _take_report(self, model_runner_output: Any) -> None:
        report: PoolReport | None = getattr(model_runner_output, REPORT_ATTR, None)
        if report is None:
            return
        self._host_ready = report.host_ready
        # A transient failure is in one report only: new even if named before.
        new = (report.failed.keys() - self._read_failures.keys()) | report.transient
        for lora_id in new:
            self.forget_adapter(lora_id)  # its pages go once its requests have failed
        self._read_failures = {i: why for i, why in report.failed.items()
                               if i not in report.transient}
        # Running requests of a newly failed adapter fail now; waiting ones of
        # a sticky failure (now or later) when the next schedule() sets them
        # aside; of a transient one now (only those: later ones load it again).
        for request in self.running if new else ():
            if request.lora_request is not None and request.lora_request.lora_int_id in new:
                self._fail_request(request, report.failed[request.lora_request.lora_int_id])
        for queue in (self.waiting, self.skipped_waiting) if report.transient else ():
            for request in queue:
                lr = request.lora_request
                if lr is not None and lr.lora_int_id in report.transient:
                    self._fail_request(request, report.failed[lr.lora_int_id])

    def _fail_request(self, request: Any, reason: str) -> None:
        """Finish `request` with an error at this step's update; `reason`
        (why its adapter cannot be served) becomes its stop_reason, which the
        API server turns into the error message."""
        if request.request_id not in self._adapter_failures:
            logger.error("vllm-loraserve: request %s: adapter %s cannot be served: %s",
                         request.request_id, request.lora_request.lora_name, reason)
            self._adapter_failures[request.request_id] = reason

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self._take_report(model_runner_output)
        failed = []
        if self._adapter_failures:
            from vllm.v1.request import RequestStatus

            # Before vLLM reads the step's tokens: a request whose adapter
            # could not be loaded ran without it, and those tokens are dropped.
            # Their KV may have been computed without the adapter (a load that
            # failed in the worker) but is hashed under its name: out of the
            # prefix cache before the blocks are freed.
            blocks = {b for rid in self._adapter_failures if rid in self.requests
                      for group in self.kv_cache_manager.get_block_ids(rid) for b in group}
            if blocks:
                self.kv_cache_manager.evict_blocks(blocks)
            failed = self.finish_requests(list(self._adapter_failures),
                                          RequestStatus.FINISHED_ERROR)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if failed:
            from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

            for request in failed:
                eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
                eco.outputs.append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=self._adapter_failures[request.request_id],
                    events=request.take_events(), trace_headers=request.trace_headers))
        self._adapter_failures.clear()
        return outputs

    def _free_request_blocks(self, request: Any) -> None:
        super()._free_request_blocks(request)
        self.adapter_pages.release(request.request_id)
        self._adapter_waits.forget(request.request_id)

    def forget_adapter(self, lora_id: int, removed: bool = False) -> None:
        """A runtime remove (`removed`), an in-place reload or a failed read:
        drop the adapter's pages once idle."""
        self.adapter_pages.forget(lora_id, removed)
        self._adapter_demands.pop(lora_id, None)
        self._read_failures.pop(lora_id, None)


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
            self.scheduler.forget_adapter(lora_id, removed=True)
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
