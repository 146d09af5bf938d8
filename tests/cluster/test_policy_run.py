"""benchmarks/cluster/policy_run.py's pure parts: the per-policy command lines
and what a replay did to the router's counters."""

from __future__ import annotations

import argparse
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "policy_run", os.path.join(ROOT, "benchmarks", "cluster", "policy_run.py"))
policy_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policy_run)


def options(**kw) -> argparse.Namespace:
    base = dict(model="/m", adapters="/a", engines=2, device="cuda", rebalance_s=5.0,
                transport="tcp", serve_args="--load-format dummy --dtype bfloat16",
                engines_per_gpu=2, gpu_memory_utilization=None)
    return argparse.Namespace(**{**base, **kw})


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_cluster_command_per_policy_and_device():
    cmd = policy_run.cluster_command(options(), "toppings", 8123, "/w/toppings")
    assert cmd[cmd.index("cluster"):cmd.index("cluster") + 2] == ["cluster", "up"]
    assert flag(cmd, "--policy") == "toppings" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "--workdir") == "/w/toppings" and flag(cmd, "--device") == "cuda"
    assert flag(cmd, "--engines-per-gpu") == "2" and "--gpu-memory-utilization" not in cmd
    # the engines' arguments stay one argument, for `cluster up` to split
    assert flag(cmd, "--serve-args") == "--load-format dummy --dtype bfloat16"
    cmd = policy_run.cluster_command(options(gpu_memory_utilization=0.8), "random", 1, "/w")
    assert flag(cmd, "--gpu-memory-utilization") == "0.8"
    # CPU engines: `cluster up` refuses the GPU flags, so none is passed
    cmd = policy_run.cluster_command(options(device="cpu", gpu_memory_utilization=0.8),
                                     "random", 1, "/w")
    assert "--engines-per-gpu" not in cmd and "--gpu-memory-utilization" not in cmd


def test_gen_and_replay_commands():
    a = argparse.Namespace(num_adapters=100, duration_s=20.0, seed=3, input_range="8,512",
                           output_range="8,64")
    cmd = policy_run.gen_command(a, 4.0, "/w/t.jsonl")
    assert flag(cmd, "--kind") == "loraserve" and flag(cmd, "--popularity") == "shifting"
    assert (flag(cmd, "--rate"), flag(cmd, "--num-adapters"), flag(cmd, "--seed")) == (
        "4.0", "100", "3")
    assert flag(cmd, "--output-range") == "8,64"
    cmd = policy_run.replay_command("/w/t.jsonl", "http://127.0.0.1:9", "/w/r.json")
    assert flag(cmd, "--url") == "http://127.0.0.1:9" and "--map-by-rank" in cmd


METRICS = """\
# TYPE loraserve_router_migrations_total counter
loraserve_router_migrations_total {mig}
# TYPE loraserve_router_fetch_bytes_total counter
loraserve_router_fetch_bytes_total{{source="peer"}} {peer}
loraserve_router_fetch_bytes_total{{source="registry"}} 500.0
# TYPE loraserve_router_requests_total counter
loraserve_router_requests_total{{adapter="a",engine="0",status="ok"}} {ok_a}
loraserve_router_requests_total{{adapter="b",engine="1",status="ok"}} 2.0
# TYPE loraserve_router_engine_inflight gauge
loraserve_router_engine_inflight{{engine="0"}} 3.0
"""


def test_moved_is_the_difference_of_the_router_counters():
    before = policy_run.counters(METRICS.format(mig=4.0, peer=100.0, ok_a=1.0))
    after = policy_run.counters(METRICS.format(mig=9.0, peer=350.0, ok_a=6.0))
    d = policy_run.moved(before, after)
    assert d["migrations"] == 5.0
    assert d["bytes_moved"] == {"peer": 250.0, "registry": 0.0}
    assert d["requests"] == {"ok": 5.0}  # summed over adapters and engines
    assert not any("inflight" in k for k in after)  # gauges are not counters
