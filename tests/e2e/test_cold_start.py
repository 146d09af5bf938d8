"""--loraserve-cold-start pipelined and cpu-assist through vLLM on the CPU:
outputs equal block's (and HF + PEFT's), loads failing at any stage fail
their own adapter alone. On the CPU engine, `pipelined` writes a layer
group when its first layer waits for it, and `cpu-assist` computes every
group of a load step on the CPU (worker/cold_start.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from .reference import IN_PROCESS, HFReference, Request, mismatches, mixed_requests, run_vllm

pytestmark = pytest.mark.e2e
MAX_TOKENS = 5
GROUP_LAYERS = 3  # the tiny model's 4 layers: groups [0, 1, 2] and [3]
MODES = ("pipelined", "cpu-assist")


def engine(mode: str, **extra) -> dict:
    return {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
            "additional_config": {"loraserve": {"cold_start": mode,
                                                "cold_start_group_layers": GROUP_LAYERS,
                                                **extra}}}


@pytest.fixture(scope="module")
def case(tiny_assets):
    model = os.path.join(tiny_assets, "model")
    adapters = [(r["name"], os.path.join(tiny_assets, r["path"]))
                for r in json.load(open(os.path.join(tiny_assets, "adapters.json")))]
    return model, mixed_requests(model, adapters, seed=5, max_len=30, without=2)


@pytest.fixture(scope="module")
def block(case, tmp_path_factory):
    model, reqs = case
    return run_vllm(tmp_path_factory.mktemp("block"), model, reqs, engine("block"), MAX_TOKENS,
                    env=IN_PROCESS)


def differences(want: dict, got: dict, atol: float = 1e-4) -> list[str]:
    """Where `got` leaves `want`'s greedy tokens, or its logprobs by more than atol."""
    out = []
    for i, (a, b) in enumerate(zip(want["token_ids"], got["token_ids"], strict=True)):
        if a != b:
            return [*out, f"token {i}: {b}, block chose {a}"]
        if abs(want["logprobs"][i] - got["logprobs"][i]) > atol:
            out.append(f"token {i}: logprob {got['logprobs'][i]:.6f}, block's "
                       f"{want['logprobs'][i]:.6f}")
    return out


@pytest.mark.parametrize("mode", MODES)
def test_cold_start_mode_equals_block_and_hf_peft(case, block, mode, tmp_path):
    model, reqs = case
    run = run_vllm(tmp_path, model, reqs, engine(mode), MAX_TOKENS,
                   env=IN_PROCESS)
    problems = [f"{r.lora_name or 'base'}: {p}"
                for r, want, got in zip(reqs, block["outputs"], run["outputs"], strict=True)
                for p in differences(want, got)]
    ref = HFReference(model)
    problems += [f"{r.lora_name or 'base'} (HF): {p}"
                 for r, o in zip(reqs, run["outputs"], strict=True)
                 for p in mismatches(ref, r, o, MAX_TOKENS)]
    assert not problems, "\n".join(problems)
    pool = run["residency"]["pool"]
    cold = pool["page_loads"] - pool["page_loads_ahead"]
    assert pool["cold_start"] == mode and pool["page_loads"] == 6 and cold > 0
    assert pool["pipelined_groups"] == 2 * cold  # two groups each
    assert pool["assisted_groups"] == (2 * cold if mode == "cpu-assist" else 0)
    # cpu-assist's deltas ran on its CPU worker processes (the default), sync-free.
    assert (pool["cpu_assist_workers"] >= 1) == (mode == "cpu-assist")
    assert (pool["sync_free_jobs"] > 0) == (mode == "cpu-assist")
    assert block["residency"]["pool"]["pipelined_groups"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_cold_load_that_fails_fails_its_adapter_alone(case, block, mode, tmp_path):
    """An adapter whose files are removed after start-up (just before the
    worker reads them), and adapters whose page packing or a page write
    (its second layer group's) fails; in cpu-assist, also the first adapter
    whose CPU deltas the workers fail (known only at the step's report, on
    the sync-free path): their requests end with an error naming why, and
    every other request equals block's output."""
    model, reqs = case
    named = list(dict.fromkeys(r.lora_name for r in reqs if r.lora_name))
    faults = dict(zip(named, ("deleted", "pack", "write"), strict=False))
    victim = tmp_path / "victim"  # a copy: the fault deletes it
    mixed = []
    for r in reqs:
        if faults.get(r.lora_name) == "deleted":
            if not victim.exists():
                shutil.copytree(r.lora_path, victim)
            r = Request(r.prompt_ids, r.lora_name, str(victim))
        mixed.append(r)
    victim_file = tmp_path / "assist_victim"
    run = run_vllm(tmp_path, model, mixed, engine(mode), MAX_TOKENS, script="faulty_load.py",
                   faults=faults, env=IN_PROCESS,
                   assist_victim=str(victim_file) if mode == "cpu-assist" else None)
    if mode == "cpu-assist":
        assisted = victim_file.read_text()
        assert assisted not in faults, assisted  # an adapter the other faults spared
        faults[assisted] = "assist"
    problems = []
    for r, want, got in zip(mixed, block["outputs"], run["outputs"], strict=True):
        if r.lora_name in faults:
            if (got["token_ids"], got["finish_reason"]) != ([], "error"):
                problems.append(f"{r.lora_name} ({faults[r.lora_name]}): {got}")
            elif faults[r.lora_name] == "deleted" and "could not be read" not in \
                    str(got["stop_reason"]):
                problems.append(f"{r.lora_name}: the error does not say why: {got}")
            elif faults[r.lora_name] == "assist" and "CPU-assisted delta failed" not in \
                    str(got["stop_reason"]):
                problems.append(f"{r.lora_name}: the error does not say why: {got}")
        else:
            problems += [f"{r.lora_name or 'base'}: {p}" for p in differences(want, got)]
    assert not problems, "\n".join(problems)
    assert not victim.exists()
