"""Per-adapter metrics: totals the workers keep are Prometheus counters."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry

from vllm_loraserve.frontend.metrics import Metrics
from vllm_loraserve.worker.report import PoolCounters

POOL = PoolCounters(
    page_loads=5, page_evictions=2, page_loads_ahead=1, load_pack_s=0.1, load_write_s=0.1,
    adapter_pages=3, total_pages=47, page_size=1024, peak_batch_adapters=2, adapter_steps=4,
    adapter_step_adapters=6, adapter_step_ranks=96, adapter_step_bytes=4096, host_bytes=100,
    host_adapters=2, host_budget=1000, prefetch_hits=3, prefetch_misses=2,
    host_overflow_loads=4, cold_start="cpu-assist", pipelined_groups=8, assisted_groups=3)


def test_worker_totals_are_counters():
    """The pool's event totals and the dropped events are monotonic: they are
    exported as counters (`_total`, TYPE counter) that follow the worker's
    totals, also across a restart of the worker's count."""
    registry = CollectorRegistry()
    m = Metrics(registry)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    m.set_pool(POOL)
    m.record_loads([], dropped=0)
    assert value("loraserve_pool_page_events_total", event="load") == 5
    assert value("loraserve_pool_page_events_total", event="load_ahead") == 1
    assert value("loraserve_pool_page_events_total", event="host_overflow") == 4
    assert value("loraserve_pool_prefetch_total", result="miss") == 2
    assert value("loraserve_pool_layer_groups_total", kind="written") == 8
    assert value("loraserve_pool_layer_groups_total", kind="assisted") == 3
    assert value("loraserve_adapter_load_events_dropped_total") == 0
    types = {f.name: f.type for f in registry.collect()}
    for family in ("loraserve_pool_page_events", "loraserve_pool_prefetch",
                   "loraserve_pool_layer_groups",
                   "loraserve_adapter_load_events_dropped"):
        assert types[family] == "counter"
    assert types["loraserve_pool_pages"] == "gauge"  # a level stays a gauge

    m.set_pool(replace(POOL, page_loads=9))
    m.set_pool(replace(POOL, page_loads=9))
    m.record_loads([("a", "device", 0.1)], dropped=4)
    m.record_loads([], dropped=4)
    assert value("loraserve_pool_page_events_total", event="load") == 9
    assert value("loraserve_pool_page_events_total", event="eviction") == 2
    assert value("loraserve_adapter_load_events_dropped_total") == 4
    assert value("loraserve_adapter_loads_total", adapter="a", tier="device") == 1
    m.set_pool(replace(POOL, page_loads=4))  # the worker counts from 0 again
    assert value("loraserve_pool_page_events_total", event="load") == 13
