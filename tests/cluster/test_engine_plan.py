"""The engine plan (cluster/engine_plan.py): which engine runs on which GPU
with which environment, command line and port, checked on CPU for 1, 2 and
4 GPUs and 1, 2 and 4 engines per GPU; and the engine actor starts what the
plan says."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from vllm_loraserve.cluster import engine as engine_mod
from vllm_loraserve.cluster.engine import Engine, EngineSpec
from vllm_loraserve.cluster.engine_plan import (
    UTIL_FLAG,
    PlanError,
    plan_engines,
    start_waves,
    visible_gpus,
)


def _share(plan) -> float:
    return float(plan.args[plan.args.index(UTIL_FLAG) + 1])


@pytest.mark.parametrize("num_gpus", [1, 2, 4])
@pytest.mark.parametrize("per_gpu", [1, 2, 4])
def test_each_gpu_holds_k_engines_that_split_its_memory(num_gpus, per_gpu):
    gpus = [str(g) for g in range(num_gpus)]
    plans = plan_engines(num_gpus * per_gpu, "cuda", "/w", ("--max-loras", "4"), gpus=gpus,
                         engines_per_gpu=per_gpu, gpu_memory_utilization=0.8)
    assert [p.index for p in plans] == list(range(num_gpus * per_gpu))
    assert Counter(p.gpu for p in plans) == dict.fromkeys(gpus, per_gpu)
    for p in plans:
        assert p.device == "cuda" and p.env == {"CUDA_VISIBLE_DEVICES": p.gpu}
        assert p.args[:2] == ("--max-loras", "4") and p.args.count(UTIL_FLAG) == 1
        assert _share(p) == pytest.approx(0.8 / per_gpu, abs=1e-4)
        cmd = p.command("vllm", "m", 9000 + p.index)
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert cmd[cmd.index("--port") + 1] == str(9000 + p.index)
        assert cmd[cmd.index("--loraserve-allowed-root") + 1] == f"/w/engine-{p.index}/adapters"
    for g in gpus:
        assert sum(_share(p) for p in plans if p.gpu == g) == pytest.approx(0.8, abs=1e-3)
    # engines sharing a GPU start one after another, different GPUs together
    waves = start_waves(plans)
    assert len(waves) == per_gpu
    assert all(sorted(plans[i].gpu for i in w) == gpus for w in waves)


def test_fewer_engines_than_slots_fill_gpus_in_order():
    plans = plan_engines(3, "cuda", "/w", gpus=["0", "1"], engines_per_gpu=2)
    assert [p.gpu for p in plans] == ["0", "0", "1"]
    assert all(_share(p) == pytest.approx(0.45) for p in plans)  # vLLM's 0.9, halved


def test_gpu_ids_are_the_launchers_visible_ones():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, 2) == ["2", "5"]
    assert visible_gpus({}, 3) == ["0", "1", "2"]
    plans = plan_engines(2, "cuda", "/w", gpus=visible_gpus({"CUDA_VISIBLE_DEVICES": "3,7"}, 2))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["3", "7"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(engines=4, gpus=["0", "1"], engines_per_gpu=1),
     "4 engines at 1 per GPU need 4 GPUs, but 2 are visible: pass --engines-per-gpu 2 or "
     "--engines 2"),
    (dict(engines=2, gpus=[]), "no CUDA device is visible"),
    (dict(engines=2, gpus=["0"], engines_per_gpu=2, gpu_memory_utilization=1.5),
     "must be in (0, 1]"),
    (dict(engines=1, gpus=["0"], engines_per_gpu=0), "at least 1"),
    (dict(engines=2, gpus=["0"], engines_per_gpu=2, serve_args=(UTIL_FLAG, "0.5")),
     "not in --serve-args"),
    (dict(engines=2, gpus=["0"], engines_per_gpu=2, serve_args=(f"{UTIL_FLAG}=0.5",)),
     "not in --serve-args"),
    # 4 engines at 0.9/4 of 80 GiB: 18 GiB each, under 20 GiB of weights
    (dict(engines=4, gpus=["0"], engines_per_gpu=4, gpu_bytes=80 << 30, model_bytes=20 << 30),
     "give each 18.0 GiB, not enough for the model's 20.0 GiB"),
])
def test_layouts_that_cannot_run_are_refused_with_what_to_change(kwargs, message):
    engines = kwargs.pop("engines")
    serve_args = kwargs.pop("serve_args", ())
    with pytest.raises(PlanError) as e:
        plan_engines(engines, "cuda", "/w", serve_args, **kwargs)
    assert message in str(e.value)


def test_a_share_that_holds_the_weights_is_accepted():
    plans = plan_engines(2, "cuda", "/w", gpus=["0"], engines_per_gpu=2,
                         gpu_bytes=80 << 30, model_bytes=14 << 30)
    assert len(plans) == 2


def test_cpu_plan_is_the_earlier_launchers():
    plans = plan_engines(3, "cpu", "/w", ("--dtype", "bfloat16"), cpu_cores=2,
                         kv_cache_gib="2")
    assert [dict(p.env) for p in plans] == [
        {"VLLM_CPU_OMP_THREADS_BIND": str(i % 2), "VLLM_CPU_KVCACHE_SPACE": "2"}
        for i in range(3)]
    assert all(p.args == ("--dtype", "bfloat16") and p.gpu is None and p.port == 0
               for p in plans)
    assert start_waves(plans) == [[0, 1, 2]]
    with pytest.raises(PlanError, match="--device cuda only"):
        plan_engines(2, "cpu", "/w", engines_per_gpu=2)
    with pytest.raises(PlanError, match="--device cuda only"):
        plan_engines(2, "cpu", "/w", gpu_memory_utilization=0.5)


def test_fixed_engine_ports():
    plans = plan_engines(3, "cpu", "/w", base_port=9100)
    assert [p.port for p in plans] == [9100, 9101, 9102]
    with pytest.raises(PlanError, match="no valid port"):
        plan_engines(2, "cpu", "/w", base_port=65535)


def test_the_engine_actor_starts_what_its_plan_says(tmp_path, monkeypatch):
    started = {}

    class FakeServer:
        def __init__(self, cmd, log, env):
            started.update(cmd=cmd, env=env)
            self.proc = type("Proc", (), {"pid": 4242})()

        def wait_ready(self, *args):
            pass

    class FakeTransport:
        async def serve(self, store):
            return "127.0.0.1:1"

    monkeypatch.setattr(engine_mod, "Server", FakeServer)
    monkeypatch.setattr(engine_mod, "vllm_executable", lambda: "vllm")
    monkeypatch.setattr(engine_mod, "make_transport", lambda *a: FakeTransport())
    plan = plan_engines(1, "cpu", str(tmp_path), ("--max-loras", "2"), base_port=9200)[0]
    engine = Engine(EngineSpec(plan, "model-dir"))
    info = asyncio.run(engine.start())
    assert started["cmd"] == plan.command("vllm", "model-dir", 9200)
    assert started["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert info["url"] == "http://127.0.0.1:9200"
    assert engine.store.root == plan.store_root


def test_cluster_up_refuses_a_layout_before_starting_anything(tmp_path, monkeypatch, capsys):
    import sys

    from vllm_loraserve.cli.main import main
    from vllm_loraserve.cluster import launch

    monkeypatch.setattr(launch, "_gpu_facts", lambda model: {"gpus": ["0"]})
    ray_before = "ray" in sys.modules
    with pytest.raises(SystemExit) as e:
        main(["cluster", "up", "--device", "cuda", "--engines", "2", "--model", "m",
              "--adapters", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert str(e.value) == ("loraserve cluster up: 2 engines at 1 per GPU need 2 GPUs, but 1 "
                            "is visible: pass --engines-per-gpu 2 or --engines 1")
    assert ("ray" in sys.modules) == ray_before  # Ray was not even imported
    assert "stopping" not in capsys.readouterr().out  # nothing started, nothing to stop
