"""benchmarks/e2e without a GPU: a config's ratio to `none` and its LoRA time
exist only where both ran the same CUDA graphs, and a run off the protocol
(or from before `--graph-size`) is marked so in the summary."""

from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "e2e"))
import bench_e2e  # noqa: E402
import step_timeline  # noqa: E402
import summary  # noqa: E402

sys.path.pop(0)


def _config(tok_s: float, graphs: int | None, steps: int = 500) -> dict:
    r = {"out_tok_s": tok_s, "gen_s": 1000 * 250 / tok_s, "engine_steps": steps}
    return r if graphs is None else {**r, "graph_max_size": graphs}


def _run(configs: dict, **protocol) -> dict:
    return {"gpu": "H200", "vllm": "0.26.0", "commit": "c", "date": "d",
            "copy_bw_bytes_s": 4e12, "configs": configs, **protocol}


def test_ratio_and_lora_time_only_against_the_same_graphs():
    run = _run({"none": _config(10000, 1024), "pool-100": _config(8000, 1024),
                "stock-100": _config(5000, 512)}, graph_size="decode")
    bench_e2e.roofline(run)
    pool, stock = run["configs"]["pool-100"], run["configs"]["stock-100"]
    assert pool["lora_ms_per_step"] == pytest.approx(1e3 * (31.25 - 25) / 500, abs=1e-3)
    assert "lora_ms_per_step" not in stock and "graphs differ" in stock["vs_none"]
    # A results file from an older bench_e2e.py may hold LoRA times against a
    # none with other graphs: computed again, they are dropped.
    stock["lora_ms_per_step"] = 7.0
    bench_e2e.roofline(run)
    assert "lora_ms_per_step" not in stock
    assert pool["steps_vs_none"] == 1.0 and "roofline_ratio" not in pool  # no bytes counted
    out = summary.summarize([run])
    assert out["pool-100"]["ratio_to_none"] == 0.8
    assert out["stock-100"]["ratio_to_none"] is None
    assert "off_protocol" not in out["pool-100"]


def test_lora_time_by_steps_and_by_total_time():
    """A pool that runs 10% more steps (its adapters take KV pages), with 40
    GB of adapters a step (10 ms at 4 TB/s), over none's 500 steps of 50 ms:
    the issue's LoRA time credits each of its steps with none's step time;
    the extra time per step charges it with all it costs beyond none; and
    the bound is none's time plus 10 ms a step for the pool's steps."""
    pool = {**_config(8000, 1024, steps=550), "adapter_bytes_timed": 550 * 40e9}
    run = _run({"none": _config(10000, 1024), "pool-1000": pool}, graph_size="decode")
    bench_e2e.roofline(run)
    r = run["configs"]["pool-1000"]
    assert r["steps_vs_none"] == pytest.approx(1 / 1.1, abs=1e-3)
    assert r["lora_ms_per_step"] == pytest.approx(31.25 / 550 * 1e3 - 50, abs=1e-3)
    assert r["extra_ms_per_step"] == pytest.approx(6.25 / 550 * 1e3, abs=1e-3)
    assert r["roofline_efficiency_total"] == pytest.approx(10 / (6.25 / 550 * 1e3), abs=1e-3)
    assert r["roofline_ratio"] == pytest.approx(25 / (25 + 550 * 0.01), abs=1e-3)
    out = summary.summarize([run])["pool-1000"]
    assert (out["extra_ms_per_step"], out["roofline_ratio"]) == (
        r["extra_ms_per_step"], r["roofline_ratio"])


def test_lora_time_against_a_none_of_the_pools_kv():
    """`none-kvN` runs the pool's steps without LoRA: a pool config's LoRA time
    against it is its time beyond that run, over its steps; a none-kv run of
    other steps (more than 1% off) or other graphs is not taken, and the
    match needs no `none` in the call."""
    assert bench_e2e.config_of("none-kv11770") == (0, False, {"num_gpu_blocks_override": 11770})
    assert bench_e2e.config_of("pool-1000") == bench_e2e.CONFIGS["pool-1000"]
    assert bench_e2e.config_env("none-kv11770") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert bench_e2e.config_env("none") == {}
    with pytest.raises(KeyError):
        bench_e2e.config_of("none-kv")
    pool = {**_config(8000, 1024, steps=550), "adapter_bytes_timed": 550 * 40e9,
            "plugin": True, "pacing": {"gpu_util_mean": 0.9}}
    far = {**_config(9900, 1024, steps=500), "plugin": True}  # pool-100: no none-kv near
    configs = {"none-kv9000": {**_config(9500, 1024, steps=553),
                               "pacing": {"gpu_util_mean": 0.98}},
               "none-kv8000": _config(9000, 1024, steps=560),
               "none-kv9100": _config(9400, 512, steps=550),  # other graphs
               "pool-1000": pool, "pool-100": far}
    for with_none in (True, False):
        run = _run({**({"none": _config(10000, 1024)} if with_none else {}), **configs},
                   graph_size="decode")
        bench_e2e.roofline(run)
        r = run["configs"]["pool-1000"]
        assert r["kv_matched"] == "none-kv9000"  # 553 steps: 0.5% off; 560: 1.8%
        assert r["kv_matched_steps"] == 553
        lora_s = (31.25 - 250 / 9.5) / 550
        assert r["lora_ms_per_step_kv_matched"] == pytest.approx(1e3 * lora_s, abs=1e-3)
        assert r["roofline_efficiency_kv_matched"] == pytest.approx(0.01 / lora_s, abs=1e-3)
        # The GPU busy beyond none-kv's busy time, and the rest idle.
        busy_s = (31.25 * 0.9 - 250 / 9.5 * 0.98) / 550
        assert r["lora_gpu_busy_ms_per_step_kv_matched"] == pytest.approx(1e3 * busy_s, abs=1e-3)
        assert r["lora_gpu_idle_ms_per_step_kv_matched"] == pytest.approx(
            1e3 * (lora_s - busy_s), abs=1e-3)
        assert "kv_matched" not in run["configs"]["pool-100"]
    out = summary.summarize([run])
    assert out["pool-1000"]["kv_matched"] == "none-kv9000" and "kv_matched" not in out["pool-100"]
    assert "lora_gpu_idle_ms_per_step_kv_matched" in out["pool-1000"]
    del configs["none-kv9000"]["pacing"]  # no NVML in one run: no split, the rest stays
    bench_e2e.roofline(run)
    r = run["configs"]["pool-1000"]
    assert "lora_gpu_busy_ms_per_step_kv_matched" not in r and "kv_matched" in r
    configs["none-kv9000"]["engine_steps"] = 600  # now none is near: nothing stale is kept
    bench_e2e.roofline(run)
    assert "kv_matched" not in run["configs"]["pool-1000"]


def test_step_trace_summary_takes_the_timed_runs_steps_apart(tmp_path):
    """Steps of the timed run only (warm-up before it, shutdown after), from
    every worker's file, and the first step of a worker (no period) left out."""
    import json

    from vllm_loraserve.worker.step_trace import ENV

    assert bench_e2e.STEP_TRACE_ENV == ENV

    def line(mono, period, loads, host=0.001, tokens=100, adapters=5, frees=None):
        allocs, retries = (None, None) if frees is None else (frees + 4, frees - 2)
        return json.dumps({"mono": mono, "period_s": period, "host_s": host,
                           "apply_s": host / 4 * (1 + loads), "cpu_s": host / 2,
                           "gap_s": period and period - host, "tokens": tokens,
                           "loads": loads, "evictions": 0, "adapters": adapters,
                           "adapter_bytes": 1, "gc_s": host / 8 * loads,
                           "gc_full": int(loads > 1), "device_allocs": allocs,
                           "device_frees": frees, "alloc_retries": retries}) + "\n"

    # Worker 11: a warm-up step, the run's first step (its period holds the
    # warm-up's end: left out), three more, and one after the run.
    (tmp_path / "pool-1000-steps-11.jsonl").write_text(
        line(5.0, None, 3) + line(9.5, 4.5, 4) + line(9.55, 0.05, 1, frees=3)
        + line(9.59, 0.04, 0) + line(9.63, 0.04, 2) + line(30.0, 20.37, 0))
    (tmp_path / "pool-1000-steps-12.jsonl").write_text(line(10.1, 0.02, 0, tokens=200))
    (tmp_path / "pool-100-steps-13.jsonl").write_text(line(10.2, 0.9, 0))  # another config
    out = bench_e2e.step_trace_summary(str(tmp_path / "pool-1000-steps"), 9.0, 20.0)
    assert out["steps"] == 4
    assert out["load_steps"] == {"n": 2, "period_ms": 45.0, "host_ms": 1.0, "apply_ms": 0.625,
                                 "cpu_ms": 0.5, "gap_ms": 44.0, "gc_ms": 0.188,
                                 "gc_full": 1, "device_frees": 3, "alloc_retries": 1,
                                 "tokens": 100.0, "adapters": 5.0, "loads": 1.5}
    assert out["other_steps"]["apply_ms"] == 0.25
    assert out["other_steps"]["n"] == 2 and out["other_steps"]["period_ms"] == 30.0
    assert out["other_steps"]["tokens"] == 150.0
    empty = bench_e2e.step_trace_summary(str(tmp_path / "none-steps"), 9.0, 20.0)
    assert empty == {"steps": 0, "load_steps": {"n": 0}, "other_steps": {"n": 0}}


GRAPHS_1024 = {"compilation_config": {"max_cudagraph_capture_size": 1024}}


@pytest.mark.parametrize("protocol, off", [
    ({}, {"graph_size": "512"}),  # a run from before --graph-size: vLLM's graphs
    ({"engine_kw": GRAPHS_1024}, {"engine_kw": GRAPHS_1024, "graph_size": "1024"}),
    ({"graph_size": "512"}, {"graph_size": "512"}),
    ({"graph_size": "decode", "warm_adapters": 200}, {"warm_adapters": 200}),
])
def test_runs_off_the_protocol_say_so(protocol, off):
    run = _run({"none": _config(10000, None), "pool-100": _config(8000, None)}, **protocol)
    assert summary.summarize([run])["pool-100"]["off_protocol"] == off


def test_configs_without_the_plugin_get_the_plugins_graphs(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    # vLLM's defaults for LLM(...) on an H100/H200
    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(
        lambda cls, world_size: ({UsageContext.LLM_CLASS: 16384},
                                 {UsageContext.LLM_CLASS: 1024})))
    assert bench_e2e.graph_kw(False, "decode", {}) == {"max_cudagraph_capture_size": 1024}
    # an engine argument the run sets counts, as it does for the plugin
    assert bench_e2e.graph_kw(False, "decode", {"max_num_seqs": 600}) == {
        "max_cudagraph_capture_size": 608}
    assert bench_e2e.graph_kw(True, "decode", {}) == {}  # the plugin's own choice
    assert bench_e2e.graph_kw(True, "512", {}) == {"max_cudagraph_capture_size": 512}


def test_calls_of_one_machine_share_its_none_and_no_other():
    """A results file without `none` is compared with the `none` of another
    call on the same machine boot (LoRA time included), never with one of
    another machine, and two candidates are an error."""
    first = _run({"none": _config(10000, 1024), "pool-100": _config(8000, 1024)},
                 machine="boot-a", graph_size="decode")
    second = _run({"pool-1000": _config(7500, 1024)}, machine="boot-a", graph_size="decode")
    other = _run({"pool-2000": _config(7000, 1024)}, machine="boot-b", graph_size="decode")
    out = summary.summarize([first, second, other])
    assert out["pool-1000"]["ratio_to_none"] == 0.75 and out["pool-1000"]["none_shared"]
    assert out["pool-1000"]["lora_ms_per_step"] == pytest.approx(
        1e3 * (1000 * 250 / 7500 - 25) / 500, abs=1e-3)
    assert "none_shared" not in out["pool-100"]
    assert out["pool-2000"]["ratio_to_none"] is None
    assert "none" not in second["configs"]  # the inputs are left as they were
    again = _run({"none": _config(9000, 1024)}, machine="boot-a", graph_size="decode")
    with pytest.raises(SystemExit, match="2 `none` runs"):
        summary.summarize([first, again, second])


def test_gpu_busy_sums_the_gaps_between_device_intervals_by_length():
    """Busy time is the union of the device's intervals; each gap between
    them lands in one length class; host events and the time before the
    first interval count in neither."""
    from types import SimpleNamespace as NS

    def ev(name, a, b, dev="CUDA"):  # µs, as torch.profiler's time ranges
        return NS(name=name, device_type=NS(name=dev), time_range=NS(start=a, end=b))

    events = [ev("gemm", 0, 1_000_000), ev("_shrink_stream_kernel_0", 500_000, 2_000_000),
              ev("_expand_kernel", 2_000_003, 3_000_000),   # after a 3 µs gap
              ev("memset", 3_000_020, 4_000_000),           # 20 µs
              ev("gemm", 4_000_500, 5_000_000),             # 500 µs
              ev("gemm", 5_003_000, 6_000_000),             # 3 ms
              ev("host op", 6_000_000, 9_000_000, dev="CPU")]
    busy = bench_e2e.gpu_busy(events, wall_s=7.0)
    assert busy["busy_s"] == pytest.approx(5.996, abs=1e-3)  # the overlap counted once
    assert busy["idle_s"] == pytest.approx(1.004, abs=1e-3)
    assert busy["lora_kernels"] == 2 and busy["device_events"] == 6
    assert {k: v["n"] for k, v in busy["idle_gaps"].items()} == {
        "<=5us": 1, "<=50us": 1, "<=1ms": 1, ">1ms": 1}
    assert busy["idle_gaps"]["<=1ms"]["s"] == pytest.approx(500e-6)
    assert busy["idle_gaps"][">1ms"]["s"] == pytest.approx(3000e-6)


# A child that starts a grandchild in its group (as vLLM starts its engine
# core), writes its pid, then exits or hangs.
FAMILY = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(g.pid))
if sys.argv[2] == "hang":
    time.sleep(60)
"""


def _gone(pid: int) -> bool:
    for _ in range(50):  # SIGKILL takes effect asynchronously
        try:
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":  # a zombie nobody reaps
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("ending", ["exit", "hang"])
def test_a_config_s_child_leaves_no_process_behind(tmp_path, ending):
    """Whether the child exits or is cut off at its time limit, its whole
    process group is gone before the next config starts: an engine core
    that outlived its parent held the GPU in session 30. A cut-off child
    gets SIGABRT first, so faulthandler writes its stacks to the log."""
    pid_file = tmp_path / "grandchild"
    with open(tmp_path / "log", "w") as log:
        rc = bench_e2e.run_child([sys.executable, "-c", FAMILY, str(pid_file), ending],
                                 dict(os.environ), log, timeout_s=10, grace_s=5)
    assert rc == ("timeout" if ending == "hang" else 0)
    assert _gone(int(pid_file.read_text()))
    if ending == "hang":
        assert "Fatal Python error: Aborted" in (tmp_path / "log").read_text()


def test_nvml_handle_is_the_first_visible_gpu():
    """NVML numbers every GPU of the machine: the engine's is the first that
    CUDA_VISIBLE_DEVICES names, by index or by UUID (device 0 without it)."""
    class Nvml:
        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return ("index", i)

        @staticmethod
        def nvmlDeviceGetHandleByUUID(u):
            return ("uuid", u)

    assert bench_e2e.nvml_handle(Nvml, "") == ("index", 0)
    assert bench_e2e.nvml_handle(Nvml, "3,1") == ("index", 3)
    assert bench_e2e.nvml_handle(Nvml, "GPU-ab12, GPU-cd34") == ("uuid", "GPU-ab12")


def test_idle_by_second_bins_the_samples_from_the_runs_start():
    """Samples fall in the second since the run's start they were taken in
    (those before it left out); a second without samples says so (None),
    not idle."""
    start = 100.0
    samples = [(99.5, 0), (100.0, 100), (100.5, 80), (101.2, 0), (103.9, 50), (103.99, 100)]
    assert bench_e2e.idle_by_second(samples, start) == [0.1, 1.0, None, 0.25]
    assert bench_e2e.idle_by_second([(98.0, 0)], start) == []
    assert bench_e2e.idle_by_second([], start) == []


def test_step_timeline_puts_each_step_in_the_second_it_started(tmp_path):
    """Steps of the timed run go to the second since its start in which they
    started (warm-up and later steps left out), beside both configs' idle
    shares; the idle seconds are the shares summed."""
    import json

    configs = {"pool-1000": {"timed_mono": [50.0, 53.5],
                             "pacing": {"gpu_idle_by_second": [0.5, None, 0.1, 0.0]}},
               "none-kv1": {"pacing": {"gpu_idle_by_second": [0.2, 0.0, 0.0, 0.0]}}}
    (tmp_path / "results.json").write_text(json.dumps({"configs": configs}))

    def line(mono, loads, gc_s=0.0, frees=None, threads=None):
        return json.dumps({"mono": mono, "tokens": 100, "loads": loads, "host_s": 0.01,
                           "apply_s": 0.002 * loads, "cpu_s": 0.008, "gc_s": gc_s,
                           "gc_full": int(gc_s > 0), "device_frees": frees,
                           "threads_cpu_s": threads or {}}) + "\n"

    (tmp_path / "pool-1000-steps-7.jsonl").write_text(
        line(49.0, 9) + line(50.0, 2, threads={"read": 0.1})
        + line(50.9, 1, gc_s=0.3, frees=2, threads={"read": 0.2, "pack": 0.05}) + line(52.2, 0)
        + line(54.0, 5))
    (tmp_path / "pool-100-steps-8.jsonl").write_text(line(50.5, 3))  # another config
    out = step_timeline.timeline(step_timeline.load_configs(str(tmp_path)),
                                 bench_e2e.read_step_trace(str(tmp_path / "pool-1000-steps")),
                                 "pool-1000", "none-kv1")
    rows = out["seconds"]
    assert [r["second"] for r in rows] == [0, 1, 2, 3]
    assert [r["steps"] for r in rows] == [2, 0, 1, 0]
    assert [r["loads"] for r in rows] == [3, 0, 0, 0]
    assert rows[0]["gc_s"] == 0.3 and rows[0]["gc_full"] == 1 and rows[0]["device_frees"] == 2
    assert rows[0]["apply_s"] == 0.006 and rows[2]["tokens"] == 100
    assert rows[0]["threads_cpu_s"] == {"read": 0.3, "pack": 0.05}
    assert rows[2]["threads_cpu_s"] == {}
    assert [r["idle"] for r in rows] == [0.5, None, 0.1, 0.0]
    assert [r["baseline_idle"] for r in rows] == [0.2, 0.0, 0.0, 0.0]
    assert out["idle_s"] == 0.6 and out["baseline_idle_s"] == 0.2
    with pytest.raises(SystemExit, match="timed_mono"):
        step_timeline.timeline({"x": {"pacing": {}}}, [], "x", None)
