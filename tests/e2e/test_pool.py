"""The paged pool inside vLLM (the default with --plugin loraserve) against
HF transformers + PEFT (fp32): more distinct adapters per batch than vLLM's
slots allow, and a page budget smaller than all the adapters together."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from transformers import AutoConfig

from vllm_loraserve.adapters.peft import inspect_adapter
from vllm_loraserve.demo.assets import ALL_TARGETS, make_adapter, module_dims
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.paging.step import TRANSIENT_NOTE

from .bad_adapters import layer_7_dims
from .reference import IN_PROCESS, HFReference, Request, mismatches, mixed_requests, run_vllm

pytestmark = pytest.mark.e2e
MAX_TOKENS = 6


# Beside the demo's six (ranks 8..128, all targets): odd ranks, partial targets.
EXTRA = {"odd-r24-qv": (24, ("q_proj", "v_proj")), "r48-all": (48, ALL_TARGETS),
         "r8-o-down": (8, ("o_proj", "down_proj")), "r96-mlp": (96, ("gate_proj", "up_proj"))}


@pytest.fixture(scope="module")
def case(tiny_assets, tmp_path_factory):
    model = os.path.join(tiny_assets, "model")
    adapters = [(r["name"], os.path.join(tiny_assets, r["path"]))
                for r in json.load(open(os.path.join(tiny_assets, "adapters.json")))]
    root = tmp_path_factory.mktemp("extra")
    for seed, (name, (rank, targets)) in enumerate(EXTRA.items()):
        make_adapter(str(root / name), module_dims(model, targets), rank=rank, alpha=2 * rank,
                     seed=100 + seed, base_model="tiny")
        adapters.append((name, str(root / name)))
    assert len(adapters) == 10
    return model, mixed_requests(model, adapters, seed=3, max_len=40, without=3)


def expected_pages(model: str, page_size: int, path: str) -> int:
    spec = inspect_adapter(path)
    layout = model_layout(AutoConfig.from_pretrained(model), page_size)
    return layout.place(spec.rank, spec.target_modules).num_pages


def check(model, reqs, outs):
    ref = HFReference(model)
    problems = [f"{r.lora_name or 'base'}: {p}" for r, o in zip(reqs, outs, strict=True)
                for p in mismatches(ref, r, o, r.max_tokens or MAX_TOKENS)]
    assert not problems, "\n".join(problems)


def test_ten_adapters_in_one_batch_with_one_vllm_slot(case, tmp_path):
    model, reqs = case
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_cpu_loras": 1, "max_num_seqs": 32,
              "max_num_batched_tokens": 2048, "additional_config": {"loraserve": {}}}
    # Engine core in-process, and every adapter read into host memory first:
    # every request is admitted in one step, which holds all ten adapters.
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, env=IN_PROCESS, read_ahead=True)
    check(model, reqs, run["outputs"])
    res = run["residency"]
    pool = res["pool"]
    assert pool["peak_batch_adapters"] == 10  # vLLM's slots would allow 1
    assert pool["page_loads"] == 10 and pool["page_evictions"] == 0
    # Where the loads' host time went (packing, writing pages), within the loads' own time.
    load_s = sum(s for _, tier, s in res["events"] if tier == "gpu")
    assert 0 < pool["load_pack_s"] and 0 < pool["load_write_s"]
    assert pool["load_pack_s"] + pool["load_write_s"] <= load_s + 1e-3
    paths = {r.lora_name: r.lora_path for r in reqs if r.lora_name}
    assert len(res["gpu"]) == 10
    # Each adapter holds the pages of its true rank; together, all adapter pages.
    want = sorted(expected_pages(model, pool["page_size"], p) for p in paths.values())
    got = sorted(res["pages"].values())
    assert got == want and sum(got) == pool["adapter_pages"]
    assert want[0] < want[-1]  # rank 8 holds fewer pages than rank 128


@pytest.mark.parametrize("read_in,read_pause", [("threads", "off"), ("processes", "off"),
                                                 ("threads", "forward")])
def test_page_pressure_evicts_idle_adapters_and_outputs_stay_exact(case, tmp_path, read_in,
                                                                   read_pause):
    """A KV cache of 60 pages cannot hold the 10 adapters (~140 pages) at
    once: idle adapters are evicted (LRU) and loaded again, no request is lost.
    The first adapter's requests run long, so it is the oldest resident one
    while others churn: an eviction that ignored use would take it. The host
    tier's reads run on its threads, or in its reader processes, or on its
    threads parked during each forward pass while another read is under way
    (--loraserve-read-pause): end to end here (exact outputs, no hang); the
    gate's parking in tests/worker/test_read_gate.py, where it is certain."""
    model, reqs = case
    first = reqs[0].lora_name
    reqs = [dataclasses.replace(r, max_tokens=40) if r.lora_name == first else r for r in reqs]
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_cpu_loras": 1, "max_num_seqs": 32,
              "num_gpu_blocks_override": 60,
              "additional_config": {"loraserve": {"host_cache_bytes": 4 << 20,
                                                  "read_in": read_in,
                                                  "read_pause": read_pause}}}
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, env=IN_PROCESS)
    check(model, reqs, run["outputs"])
    pool = run["residency"]["pool"]
    assert pool["total_pages"] == 60 and pool["adapter_pages"] <= 59
    assert pool["page_evictions"] > 0 and pool["page_loads"] >= 10
    # The host tier stays in its arena: the 4 MiB budget grows to one chunk
    # that holds the largest adapter (rank 128 everywhere in fp32: 4.75 MiB).
    assert pool["host_budget"] == 8 << 20 and pool["host_bytes"] <= 8 << 20
    # --loraserve-read-threads' default: 4 processes, which read every file
    # (at least the 10 adapters' first reads), none replaced; or none at all.
    if read_in == "processes":
        assert pool["reader_processes"] == 4 and pool["reader_respawns"] == 0
        assert pool["reader_reads"] >= 10
    else:
        assert pool["reader_processes"] == pool["reader_reads"] == 0
    if read_pause == "off":
        assert pool["read_paused_s"] == 0


@pytest.mark.parametrize("mode", ["block", "cpu-assist"])
def test_a_step_whose_adapters_overflow_the_host_tier_stays_exact(case, tmp_path, mode):
    """All ten adapters load in the first step, each read inside it (no read
    ahead, no wait for reads: cold_reads.py), and the host tier holds one
    8 MiB chunk, less than their files together: the step loads the adapters
    it took before it reads more into their memory (`host_overflow_loads`),
    never overwriting bytes a load still copies. Outputs stay exact."""
    model, reqs = case
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
              "max_num_batched_tokens": 2048,
              "additional_config": {"loraserve": {"host_cache_bytes": 4 << 20,
                                                  "cold_start": mode}}}
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, script="cold_reads.py",
                   env=IN_PROCESS)
    check(model, reqs, run["outputs"])
    pool = run["residency"]["pool"]
    assert pool["host_budget"] == 8 << 20 and pool["peak_batch_adapters"] == 10
    assert pool["page_loads"] == 10 and pool["prefetch_misses"] == 10
    assert 0 < pool["host_overflow_loads"] < 10


def test_adapters_of_waiting_requests_are_loaded_ahead_into_free_pages(case, tmp_path):
    """Two requests run at a time (max_num_seqs 2), so most wait with their
    adapter already in the host tier and KV pages free: those adapters are
    loaded into pages before their requests' admission, each once, and
    outputs stay exact (a wrong or unfinished ahead load would change them)."""
    model, reqs = case
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 2,
              "additional_config": {"loraserve": {}}}
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS,
                   env=IN_PROCESS)
    check(model, reqs, run["outputs"])
    pool = run["residency"]["pool"]
    assert pool["page_loads"] == 10 and pool["page_evictions"] == 0
    assert pool["page_loads_ahead"] >= 5


def test_an_adapter_the_pool_cannot_serve_fails_alone(case, tiny_assets, tmp_path):
    """Offline LLM has no API-server checks: an lm_head adapter reaches the
    scheduler, which fails its requests and keeps serving the others."""
    model, reqs = case
    head = str(tmp_path / "head-r8")
    make_adapter(head, module_dims(model, ("lm_head", "v_proj")), rank=8, alpha=8, seed=5,
                 base_model="tiny")
    bad = Request(reqs[0].prompt_ids, "head-r8", head)
    mixed = [bad, *reqs[:6]]
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
              "additional_config": {"loraserve": {}}}
    run = run_vllm(tmp_path, model, mixed, engine, MAX_TOKENS, env=IN_PROCESS)
    assert run["outputs"][0]["token_ids"] == [] and run["outputs"][0]["finish_reason"] == "error"
    check(model, mixed[1:], run["outputs"][1:])


def test_a_load_that_fails_at_any_stage_fails_its_adapter_alone(case, tiny_assets, tmp_path):
    """Issue 22: an adapter naming a layer the model lacks (its shapes fit, so
    no check before the worker's read sees it) killed the engine at its page
    load. Now that, and any exception while reading, packing or writing one
    adapter's pages, fails that adapter's requests alone: the others equal
    HF + PEFT, in the same batches."""
    model, reqs = case
    layer_7 = str(tmp_path / "layer-7")
    make_adapter(layer_7, layer_7_dims(model), rank=8, alpha=16, seed=4, base_model="tiny")
    good = reqs[:8]
    named = [r.lora_name for r in good if r.lora_name]
    faults = {name: stage for name, stage in zip(dict.fromkeys(named),
                                                 ("read", "pack", "write"), strict=False)}
    assert len(faults) == 3
    bad = [Request(reqs[0].prompt_ids, "layer-7", layer_7), *(
        r for r in reqs if r.lora_name in faults)]
    ok = [r for r in reqs if r.lora_name not in faults]
    mixed = [*bad, *ok]
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
              "additional_config": {"loraserve": {}}}
    run = run_vllm(tmp_path, model, mixed, engine, MAX_TOKENS, script="faulty_load.py",
                   faults=faults, env=IN_PROCESS)
    for r, out in zip(bad, run["outputs"], strict=False):
        assert (out["token_ids"], out["finish_reason"]) == ([], "error"), r.lora_name
    check(model, ok, run["outputs"][len(bad):])
    assert len({r.lora_name for r in ok if r.lora_name}) >= 5


def test_a_transient_load_failure_fails_its_requests_once(case, tmp_path):
    """An I/O error (EIO) reading one adapter and CUDA's out-of-memory error
    packing another fail the requests waiting for those loads, with a reason
    that says so, and nothing else: the same requests run again afterwards
    load both afresh, and every output equals HF + PEFT."""
    model, reqs = case
    named = list(dict.fromkeys(r.lora_name for r in reqs if r.lora_name))
    faults = {named[0]: "read-eio-once", named[1]: "pack-oom-once"}
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
              "additional_config": {"loraserve": {}}}
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, script="faulty_load.py",
                   faults=faults, again=True, env=IN_PROCESS)
    failed = [(r, out) for r, out in zip(reqs, run["outputs"], strict=True)
              if r.lora_name in faults]
    assert failed
    for r, out in failed:
        assert (out["token_ids"], out["finish_reason"]) == ([], "error"), r.lora_name
        assert "injected" in out["stop_reason"] and out["stop_reason"].endswith(TRANSIENT_NOTE)
    check(model, [r for r in reqs if r.lora_name not in faults],
          [o for r, o in zip(reqs, run["outputs"], strict=True) if r.lora_name not in faults])
    check(model, reqs, run["again"])


def test_a_slow_adapter_read_does_not_hold_up_the_batch(case, tmp_path):
    """One adapter's disk read stalls until every other request has finished:
    its requests wait in the queue while the others run (a step that waited
    on the read would stall until the 60 s timeout, and they would finish
    together). Outputs stay exact, the slow one's included."""
    model, reqs = case
    slow = reqs[0].lora_name
    engine = {"max_loras": 1, "max_lora_rank": 128, "max_num_seqs": 32,
              "additional_config": {"loraserve": {}}}
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, script="slow_read.py", slow=slow,
                   env=IN_PROCESS)
    check(model, reqs, run["outputs"])
    finished, slow_ids = run["finished"], set(run["slow_ids"])
    assert len(slow_ids) == 2 and set(finished[-2:]) == slow_ids
    pool, waits = run["residency"]["pool"], run["residency"]["adapter_waits"]
    # Every adapter read in the background before its requests were admitted.
    assert pool["prefetch_misses"] == 0 and pool["prefetch_hits"] == pool["page_loads"] == 10
    assert len(waits) == len(reqs) - 3 and max(waits) > 0
