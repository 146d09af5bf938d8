"""benchmarks/e2e/admission_sim.py: the step simulation serves every request in
full, keeps its page accounting within the pool, is deterministic, and with
the project's affinity policy passes no request over more than MAX_WAIT_STEPS
steps while it waits. Whether affinity beats FCFS is for the benchmark to measure."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest

from vllm_loraserve.scheduler import admission

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "e2e"))
import admission_sim as sim  # noqa: E402

sys.path.pop(0)

# KV is tight: 200 requests would hold ~6000 pages at once; 50 adapters hold ~620.
SMALL = {"n_requests": 200, "pool_pages": 1200}


@pytest.mark.parametrize("policy", ["fcfs", "affinity"])
def test_every_request_served_within_the_pool(policy: str) -> None:
    run = sim.simulate(50, 1, policy, **SMALL)
    assert run.preemptions > 0  # the workload reaches preemption, as it is meant to
    assert run.generated == [r.output for r in sim.workload(200, 50, 1)]
    for free, kv, adapters in run.pages:
        assert free >= 0 and kv >= 0 and adapters >= 0
        assert free + kv + adapters == SMALL["pool_pages"]


@pytest.mark.parametrize("policy", ["fcfs", "affinity"])
def test_same_seed_same_run(policy: str) -> None:
    assert sim.simulate(50, 3, policy, **SMALL) == sim.simulate(50, 3, policy, **SMALL)
    assert sim.simulate(50, 3, policy, **SMALL) != sim.simulate(50, 4, policy, **SMALL)


def test_no_lora_reads_no_adapter_bytes() -> None:
    run = sim.simulate(0, 1, **SMALL)
    assert sum(run.adapter_bytes) == 0 and not any(run.adapters)
    assert all(adapters == 0 for _, _, adapters in run.pages)


def test_passes_are_counted_per_waiting_spell() -> None:
    a, b, c = (sim.Request(str(i), None, 8, 8) for i in range(3))
    passes: dict[str, int] = {}
    assert sim.count_passes([a, b, c], {b}, passes) == 1 and passes == {"0": 1}
    assert sim.count_passes([a, c], set(), passes) == 1  # nothing admitted: nobody passed
    assert sim.count_passes([c, a], {c}, passes) == 1  # admitted ahead of a: not a pass
    assert sim.count_passes([a], {a}, passes) == 0 and passes == {}


def test_fcfs_passes_no_request_over() -> None:
    assert sim.simulate(50, 1, "fcfs", **SMALL).max_passed_over == 0


@pytest.mark.parametrize("bound", [1, 2, admission.MAX_WAIT_STEPS])
def test_affinity_passes_a_request_over_at_most_its_bound(monkeypatch, bound: int) -> None:
    # Unbounded, affinity passes some request here over 3 times in one wait: 1 binds.
    monkeypatch.setitem(admission.ADMISSIONS, "bounded",
                        functools.partial(admission.AdapterAffinity, max_wait_steps=bound))
    passed = max(sim.simulate(50, s, "bounded", **SMALL).max_passed_over for s in range(3))
    assert 0 < passed <= bound


def test_cli_writes_paired_results(tmp_path) -> None:
    out = tmp_path / "r.json"
    sim.main(["--adapters", "10", "--seeds", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    fcfs = results["10/fcfs"]["mean_and_delta"]
    assert all(delta == 0 for _, delta in fcfs.values())
    assert 0 < results["10/affinity"]["mean_and_delta"]["throughput/no-LoRA"][0] <= 1
