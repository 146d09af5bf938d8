"""The paged pool on a Hopper GPU (marker `gpu`; run through the device tool).

vLLM 0.26 with its defaults (bf16, torch.compile, CUDA graphs), the pool's
Triton kernels, 8 adapters of mixed ranks and targets with one vLLM slot,
base requests in the same batches. Two oracles, neither of which can pass
or fail by a lucky tie:

- logprobs against HF transformers + PEFT in fp32 (teacher-forced on the
  pool's own tokens), per request: mean and largest |delta| within
  `Bf16Tolerance` (tests/e2e/reference.py: about twice the worst bf16 noise
  seen in 11 runs, of the pool and of stock vLLM); the same statistics for
  stock vLLM LoRA are recorded beside them. Each adapter's own effect (the
  reference with it against without it) must be well above the mean bound,
  so a pool that dropped or mixed up an adapter cannot pass;
- greedy tokens against stock vLLM LoRA (no plugin): identical up to the
  first position where they differ, and there the fp32 reference must call
  the two tokens a near tie (gap <= the tolerance's tie gap); after it the
  sequences are different inputs and are not compared.

The pool's engines run with vLLM's JIT monitor in error mode: a kernel
compiled while serving (not in the pool's warm-up at bind) fails the run.

With LORASERVE_MODEL_RUNNER=auto the pool's engines run on vLLM's V2 model
runner (--loraserve-model-runner auto, experimental).

Results (per-request deltas, divergences) go to
$LORASERVE_RESULTS_DIR/gpu_pool.json, gpu_pool_ahead.json and gpu_pool_llama3.json.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from ..e2e.reference import (
    IN_PROCESS,
    Bf16Tolerance,
    HFReference,
    Request,
    adapter_effect,
    bf16_problems,
    logprob_deltas,
    run_vllm,
)
from .case import ADAPTERS, LLAMA3_ADAPTERS, MAX_TOKENS, build_case

pytestmark = pytest.mark.gpu
TOL = Bf16Tolerance()
# An adapter whose effect is below this could be dropped unnoticed.
MIN_EFFECT = 2 * TOL.mean
# Any Triton compile after vLLM's warm-up raises in the engine (vllm/utils/jit_monitor.py).
# LORASERVE_MODEL_RUNNER=auto runs the pool on vLLM's V2 runner (experimental).
POOL = {"max_loras": 1, "jit_monitor_mode": "error", "additional_config": {"loraserve": {
    "model_runner": os.environ.get("LORASERVE_MODEL_RUNNER", "v1")}}}


@pytest.fixture(scope="module")
def case(fixed_dir):
    return build_case(fixed_dir("pool-gpu"))


def _check_against_reference(ref: HFReference, req: Request, out: dict, lp: torch.Tensor,
                              problems: list[str]) -> dict:
    """Append what is wrong with `out` to `problems` (`lp`: the reference's
    logprobs on its tokens); the request's statistics."""
    name = req.lora_name or "base"
    assert len(out["token_ids"]) == MAX_TOKENS, f"{name}: {out}"
    d = logprob_deltas(lp, out)
    problems += bf16_problems(name, d, TOL)
    stats = {"adapter": name, "pool_max": max(d), "pool_mean": sum(d) / len(d)}
    if req.lora_name is not None:
        stats["effect"] = adapter_effect(ref, req, out["token_ids"], lp)
        if stats["effect"] < MIN_EFFECT:
            problems.append(f"{name}: the adapter moves logprobs by only "
                            f"{stats['effect']:.3f}; the test cannot see it")
    return stats


def _write_report(report: dict, file: str) -> None:
    out_dir = os.environ.get("LORASERVE_RESULTS_DIR")
    if out_dir:
        json.dump(report, open(os.path.join(out_dir, file), "w"), indent=1)


def _pool_against_reference(tmp_path, model: str, reqs: list[Request], engine: dict,
                            file: str) -> tuple[dict, list[str]]:
    """One pool engine (in-process core) on `reqs`, each request checked
    against HF + PEFT; the report (written to `file`) and the problems."""
    pool = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS,
                    env=IN_PROCESS, dtype="bfloat16")
    ref = HFReference(model, device="cuda")
    problems: list[str] = []
    report = {"tolerance": dataclasses.asdict(TOL), "pool": pool["residency"]["pool"],
              "requests": [_check_against_reference(ref, req, out,
                                                    ref.logprobs(req, out["token_ids"]), problems)
                           for req, out in zip(reqs, pool["outputs"], strict=True)]}
    _write_report(report, file)
    return report, problems


def test_pool_bf16_matches_hf_peft_and_stock_vllm(case, tmp_path):
    model, reqs = case
    engine = {"max_lora_rank": 128, "max_num_seqs": 64, "gpu_memory_utilization": 0.5}
    for d in ("pool", "stock"):
        (tmp_path / d).mkdir()
    # Engine core in-process: all requests are queued before the first step.
    env = IN_PROCESS
    pool = run_vllm(tmp_path / "pool", model, reqs, {**engine, **POOL}, MAX_TOKENS, env=env,
                    dtype="bfloat16")
    stock = run_vllm(tmp_path / "stock", model, reqs, {**engine, "max_loras": 8}, MAX_TOKENS,
                     env=env, dtype="bfloat16")
    ref = HFReference(model, device="cuda")
    report = {"tolerance": dataclasses.asdict(TOL), "tie_gap": TOL.tie_gap, "requests": []}
    problems: list[str] = []
    for req, p, s in zip(reqs, pool["outputs"], stock["outputs"], strict=True):
        lp = ref.logprobs(req, p["token_ids"])
        stats = _check_against_reference(ref, req, p, lp, problems)
        ds = logprob_deltas(ref.logprobs(req, s["token_ids"]), s)
        diverge = next((i for i, (a, b) in enumerate(zip(p["token_ids"], s["token_ids"],
                                                          strict=True)) if a != b), None)
        gap = None
        if diverge is not None:
            at = lp[diverge]
            gap = abs(float(at[p["token_ids"][diverge]] - at[s["token_ids"][diverge]]))
            if gap > TOL.tie_gap:
                problems.append(f"{stats['adapter']}: greedy differs from stock vLLM at "
                                f"{diverge} (fp32 gap {gap:.3f})")
        report["requests"].append({**stats, "stock_max": max(ds),
                                   "stock_mean": sum(ds) / len(ds), "diverge": diverge,
                                   "gap": gap})
    report["pool"] = pool["residency"]["pool"]
    _write_report(report, "gpu_pool.json")
    assert report["pool"]["peak_batch_adapters"] == len(ADAPTERS)
    assert not problems, "\n".join(problems)
    assert torch.cuda.is_available()


def test_loads_ahead_on_the_side_stream_match_hf_peft(case, tmp_path):
    """Four requests run at a time, so adapters of waiting requests are
    loaded ahead into free pages on the worker's side stream, beside the
    step's forward pass; each must be complete before its requests run."""
    model, reqs = case
    engine = {"max_lora_rank": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.5, **POOL}
    report, problems = _pool_against_reference(tmp_path, model, reqs, engine,
                                                "gpu_pool_ahead.json")
    assert report["pool"]["page_loads_ahead"] > 0, report["pool"]
    assert not problems, "\n".join(problems)


def test_pool_llama3_8b_layers_gqa_all_linear_match_hf_peft(fixed_dir, tmp_path):
    """Issue 23: the shapes users serve. Two layers of Llama-3-8B (GQA 32/8,
    MLP 14336), adapters of ranks 16-64 on all linear layers (qkv, o,
    gate_up, down: every layer kind vLLM wraps), against HF + PEFT in fp32."""
    model, reqs = build_case(fixed_dir("pool-gpu-llama3"), "llama3-8b-layers", LLAMA3_ADAPTERS)
    engine = {"max_lora_rank": 64, "max_num_seqs": 64, "gpu_memory_utilization": 0.5, **POOL}
    report, problems = _pool_against_reference(tmp_path, model, reqs, engine,
                                                "gpu_pool_llama3.json")
    assert report["pool"]["peak_batch_adapters"] == len(LLAMA3_ADAPTERS)
    assert not problems, "\n".join(problems)
