"""ResidencyReport: its wire form survives vLLM's engine -> API server path,
with the keys offline scripts read."""

from __future__ import annotations

import pickle

import pytest
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

from vllm_loraserve.worker.report import LoadEvent, PoolCounters, ResidencyReport

COUNTERS = PoolCounters(
    page_loads=7, page_evictions=2, page_loads_ahead=1, load_pack_s=0.0125,
    load_write_s=0.003, adapter_pages=40, total_pages=512, page_size=4096,
    peak_batch_adapters=3, adapter_steps=9, adapter_step_adapters=21, adapter_step_ranks=336,
    adapter_step_bytes=123_456_789, host_bytes=1 << 20, host_adapters=4, host_budget=1 << 30,
    prefetch_hits=6, prefetch_misses=1)
PAGED = ResidencyReport(
    gpu=(3, 11), host=(5,), events=(LoadEvent(5, "host", 0.25), LoadEvent(11, "gpu", 0.001)),
    dropped_events=2, pages={3: 16, 11: 24}, adapter_waits=(0.0, 0.5), pool=COUNTERS)
SLOTS = ResidencyReport(gpu=(1,), host=(), events=(LoadEvent(1, "host", 0.1),),
                        dropped_events=0)


def _engine_to_api_server(wire):
    """Worker -> engine core (pickled by the executor's message queue), then
    engine core -> API server as a utility call's result (vLLM's msgpack)."""
    result = pickle.loads(pickle.dumps(wire))
    out = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1,
                                                         result=UtilityResult(result)))
    frames = MsgpackEncoder().encode(out)
    return MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.result.result


@pytest.mark.parametrize("report", [PAGED, SLOTS], ids=["paged", "vllm-slots"])
def test_the_report_survives_the_process_boundaries(report):
    assert ResidencyReport.from_wire(_engine_to_api_server(report.to_wire())) == report


def test_wire_keys_are_the_ones_scripts_read():
    """benchmarks/e2e/bench_e2e.py, examples/offline_llm.py and the e2e tests
    index the wire form by these names."""
    wire = PAGED.to_wire()
    assert list(wire) == ["gpu", "host", "pages", "events", "dropped_events", "adapter_waits",
                          "pool"]
    assert list(wire["pool"]) == [
        "page_loads", "page_evictions", "page_loads_ahead", "load_pack_s", "load_write_s",
        "adapter_pages", "total_pages", "page_size", "peak_batch_adapters", "adapter_steps",
        "adapter_step_adapters", "adapter_step_ranks", "adapter_step_bytes", "host_bytes",
        "host_adapters", "host_budget", "prefetch_hits", "prefetch_misses",
        "host_overflow_loads", "cold_start",
        "pipelined_groups", "assisted_groups", "cpu_assist_workers", "sync_free_jobs",
        "reader_processes", "reader_reads", "reader_respawns", "read_paused_s"]
    assert wire["pool"]["adapter_step_bytes"] == 123_456_789
    assert wire["pages"] == {3: 16, 11: 24} and wire["events"][0] == (5, "host", 0.25)
    assert list(SLOTS.to_wire()) == ["gpu", "host", "events", "dropped_events"]


def test_pages_and_pool_counters_come_together():
    with pytest.raises(ValueError, match="pages and pool counters together"):
        ResidencyReport(gpu=(), host=(), events=(), dropped_events=0, pages={})
    with pytest.raises(ValueError, match="pages and pool counters together"):
        ResidencyReport.from_wire({k: v for k, v in PAGED.to_wire().items() if k != "pages"})
