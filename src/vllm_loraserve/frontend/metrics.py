"""Per-adapter Prometheus metrics, served on vLLM's own `/metrics`.

Two sources feed them, both in the API server process:
- requests and tokens: vLLM's output processor knows each request's adapter
  name; two wrapped methods of `OutputProcessor` (vllm/v1/engine/
  output_processor.py) add per-adapter tallies to the step's `IterationStats`,
  and `LoraServeStatLogger` (a `vllm.stat_logger_plugins` entry) turns them
  into counters. vLLM's own `vllm:lora_requests_info` only has a gauge with
  comma-joined names.
- adapter loads and residency: workers time their loads (worker/residency.py);
  `frontend/endpoint.py` drains those events when `/metrics` is scraped.
  Totals the workers keep since start (pool page loads, prefetch results,
  dropped events) are counters here too: each scrape adds what they grew by.

Every adapter is one label value; requests without an adapter are counted
under the served base model name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_loraserve._patching import wrap
from vllm_loraserve.config import from_vllm_config
from vllm_loraserve.frontend.serving import note_engine_failure
from vllm_loraserve.worker.report import PoolCounters

_TALLY_ATTR = "loraserve_by_adapter"


class _Tally:
    __slots__ = ("prompt_tokens", "generation_tokens", "finished")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: list[str] = []


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.requests = Counter(
            "loraserve_adapter_requests", "Finished requests per adapter.",
            ["adapter", "finished_reason"], registry=r)
        self.prompt_tokens = Counter(
            "loraserve_adapter_prompt_tokens", "Prompt tokens per adapter.", ["adapter"],
            registry=r)
        self.generation_tokens = Counter(
            "loraserve_adapter_generation_tokens", "Generated tokens per adapter.",
            ["adapter"], registry=r)
        self.loads = Counter(
            "loraserve_adapter_loads",
            "Adapter loads per adapter and tier (host: disk to host memory; "
            "device: host memory to the slots or pool pages the kernels read).",
            ["adapter", "tier"], registry=r)
        self.load_seconds = Histogram(
            "loraserve_adapter_load_seconds", "Adapter load latency.", ["tier"], registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.adapters = Gauge(
            "loraserve_adapters", "Known adapters by state (disk, host, device, invalid).",
            ["state"], registry=r)
        self.dropped_load_events = Counter(
            "loraserve_adapter_load_events_dropped",
            "Load events a worker dropped because /metrics was not scraped in time "
            "(the load counters undercount by this much).", registry=r)
        # The paged pool, as the worker last reported it.
        self.pool_pages = Gauge(
            "loraserve_pool_pages",
            "KV cache pages of the paged pool: held by adapters, and in total (the rest "
            "hold KV or are free).", ["kind"], registry=r)
        self.pool_events = Counter(
            "loraserve_pool_page_events",
            "Adapter page loads (host tier to KV pages) and evictions; load_ahead: the "
            "loads among them made for waiting requests before their admission (copied "
            "beside a step's forward pass on a GPU); host_overflow: those a step issued "
            "before reading its other adapters, its adapters outgrowing the host tier "
            "(raise --loraserve-host-cache-bytes).", ["event"], registry=r)
        self.pool_host_bytes = Gauge(
            "loraserve_pool_host_bytes", "Bytes of adapters held in the pool's host tier.",
            registry=r)
        self.pool_prefetch = Counter(
            "loraserve_pool_prefetch",
            "Adapter page loads whose adapter was already in the host tier (hit: read "
            "ahead or kept) or had to be read during the step (miss).", ["result"],
            registry=r)
        self.pool_groups = Counter(
            "loraserve_pool_layer_groups",
            "Layer groups of cold adapters' page loads (--loraserve-cold-start): written "
            "beside the forward pass (written), and among them those whose LoRA delta "
            "was computed on the CPU until their pages landed (assisted).", ["kind"],
            registry=r)
        self.adapter_wait_seconds = Histogram(
            "loraserve_adapter_wait_seconds",
            "Time a request waited in the queue for its adapter to be read into the host "
            "tier (0 when it was ready), per admitted request with an adapter.", registry=r,
            buckets=(0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        # The worker's last totals per counter series, to add what they grew by.
        self._totals: dict[tuple[Counter, tuple[str, ...]], int] = {}

    def _advance(self, counter: Counter, total: int, *labels: str) -> None:
        """Bring `counter` up to a total the worker counts since its start
        (a smaller total than the last one: the worker started over)."""
        last = self._totals.get((counter, labels), 0)
        self._totals[counter, labels] = total
        grown = total - last if total >= last else total
        series = counter.labels(*labels) if labels else counter  # listed from 0 on
        if grown:
            series.inc(grown)

    def set_pool(self, pool: PoolCounters) -> None:
        self.pool_pages.labels("adapter").set(pool.adapter_pages)
        self.pool_pages.labels("total").set(pool.total_pages)
        self._advance(self.pool_events, pool.page_loads, "load")
        self._advance(self.pool_events, pool.page_evictions, "eviction")
        self._advance(self.pool_events, pool.page_loads_ahead, "load_ahead")
        self._advance(self.pool_events, pool.host_overflow_loads, "host_overflow")
        self.pool_host_bytes.set(pool.host_bytes)
        self._advance(self.pool_prefetch, pool.prefetch_hits, "hit")
        self._advance(self.pool_prefetch, pool.prefetch_misses, "miss")
        self._advance(self.pool_groups, pool.pipelined_groups, "written")
        self._advance(self.pool_groups, pool.assisted_groups, "assisted")

    def record_waits(self, seconds: Iterable[float]) -> None:
        for s in seconds:
            self.adapter_wait_seconds.observe(s)

    def record_loads(self, events: list[tuple[str, str, float]], dropped: int) -> None:
        for adapter, tier, seconds in events:
            self.loads.labels(adapter, tier).inc()
            self.load_seconds.labels(tier).observe(seconds)
        self._advance(self.dropped_load_events, dropped)

    def set_states(self, counts: dict[str, int]) -> None:
        for state, n in counts.items():
            self.adapters.labels(state).set(n)


@functools.cache
def metrics() -> Metrics:
    """The process-wide metric objects (prometheus-client allows one of each)."""
    return Metrics()


def _tally(iteration_stats: Any, lora_name: str | None) -> _Tally:
    tallies = iteration_stats.__dict__.setdefault(_TALLY_ATTR, {})
    tally = tallies.get(lora_name)
    if tally is None:
        tally = tallies[lora_name] = _Tally()
    return tally


def _make_update_from_output(update):
    def patched(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats):
        update(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)
        # The pool scheduler fails a request whose adapter cannot be served
        # with FINISHED_ERROR and the reason as its stop_reason.
        if engine_core_output.finish_reason == FinishReason.ERROR and req_state.lora_name \
                and isinstance(engine_core_output.stop_reason, str):
            note_engine_failure(req_state, engine_core_output.stop_reason)
        if iteration_stats is not None:
            tally = _tally(iteration_stats, req_state.lora_name)
            if req_state.is_prefilling:
                tally.prompt_tokens += req_state.prompt_len
            tally.generation_tokens += len(engine_core_output.new_token_ids)

    return patched


def _make_update_from_finished(update):
    def patched(self, req_state, finish_reason, iteration_stats):
        update(self, req_state, finish_reason, iteration_stats)
        if iteration_stats is not None:
            _tally(iteration_stats, req_state.lora_name).finished.append(str(finish_reason))

    return patched


def install_output_tallies() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    wrap(OutputProcessor, "_update_stats_from_output", _make_update_from_output)
    wrap(OutputProcessor, "_update_stats_from_finished", _make_update_from_finished)


class LoraServeStatLogger(StatLoggerBase):
    """`vllm.stat_logger_plugins` entry: per-adapter request and token counters.

    Does nothing unless the plugin is active for the engine it logs for.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.active = from_vllm_config(vllm_config) is not None
        if self.active:
            install_output_tallies()
            self.metrics = metrics()
            self.base_name = vllm_config.model_config.served_model_name

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if not self.active or iteration_stats is None:
            return
        m = self.metrics
        for lora_name, tally in iteration_stats.__dict__.get(_TALLY_ATTR, {}).items():
            adapter = lora_name or self.base_name
            if tally.prompt_tokens:
                m.prompt_tokens.labels(adapter).inc(tally.prompt_tokens)
            if tally.generation_tokens:
                m.generation_tokens.labels(adapter).inc(tally.generation_tokens)
            for reason in tally.finished:
                m.requests.labels(adapter, reason).inc()

    def log_engine_initialized(self) -> None:
        pass
