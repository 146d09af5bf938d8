"""HF transformers + PEFT in fp32: the reference vLLM is compared with."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Request:
    prompt_ids: list[int]
    lora_name: str | None = None
    lora_path: str | None = None
    max_tokens: int | None = None  # None: the run's max_tokens


def mixed_requests(model: str, adapters: list[tuple[str, str]], seed: int, max_len: int,
                   without: int) -> list[Request]:
    """Two requests of 4..max_len random prompt tokens per (name, path) adapter
    and `without` 9-token requests without one, shuffled (seeded)."""
    vocab = len(json.load(open(os.path.join(model, "tokenizer.json")))["model"]["vocab"])
    rng = random.Random(seed)
    reqs = [Request([rng.randrange(8, vocab) for _ in range(rng.randint(4, max_len))], name,
                    path) for name, path in adapters for _ in range(2)]
    reqs += [Request([rng.randrange(8, vocab) for _ in range(9)]) for _ in range(without)]
    rng.shuffle(reqs)
    return reqs


# The engine core in the script's process (run_vllm's env): every request is
# queued before the first step, and the run skips ~40 s of process start-up
# on a 2-core machine. Servers and examples/ keep vLLM's processes.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_vllm(tmp_path, model: str, requests: list[Request], engine: dict, max_tokens: int,
             env: dict | None = None, dtype: str = "float32", script: str = "vllm_generate.py",
             **spec):
    """{"outputs": greedy tokens and logprobs per request, "lora_modules": the
    workers' module table or None, "residency": the workers' report or None}
    from vLLM, in a fresh process running `script` (`spec`: its extra keys)."""
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    json.dump({"model": model, "dtype": dtype, "engine": engine, "max_tokens": max_tokens,
               "requests": [r.__dict__ for r in requests], **spec}, open(spec_path, "w"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, os.path.join(HERE, script),
                           str(spec_path), str(out_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.load(open(out_path))


class HFReference:
    """Teacher-forced log-probabilities of a token sequence under base or adapter
    (in fp32; `dtype` other than that only stands in for a server in tests of
    the oracles themselves)."""

    def __init__(self, model_dir: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype).to(device).eval()
        self.peft = None

    def _model_for(self, req: Request):
        import peft

        if req.lora_name is None:
            return self.peft.disable_adapter() if self.peft else _null(), self.model
        if self.peft is None:
            self.peft = peft.PeftModel.from_pretrained(self.model, req.lora_path,
                                                       adapter_name=req.lora_name).eval()
        elif req.lora_name not in self.peft.peft_config:
            self.peft.load_adapter(req.lora_path, adapter_name=req.lora_name)
        self.peft.set_adapter(req.lora_name)
        return _null(), self.peft

    @torch.no_grad()
    def logprobs(self, req: Request, output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), vocab] log-probs at each generated position."""
        ctx, model = self._model_for(req)
        ids = torch.tensor([req.prompt_ids + output_ids[:-1]], device=self.device)
        with ctx:
            logits = model(ids).logits[0, len(req.prompt_ids) - 1:]
        return torch.log_softmax(logits.float(), dim=-1).cpu()


@dataclass(frozen=True)
class Bf16Tolerance:
    """How far bf16 serving may sit from the fp32 reference on one request's
    tokens (|logprob delta|, nats). Over 11 GPU runs of tests/gpu/test_pool_gpu.py
    (H100 and H200, the pool and stock vLLM LoRA; docs/benchmarks/e2e.md,
    session 8) the worst request mean was 0.038 and the worst token 0.155, both
    for stock vLLM too: each bound is about twice that, so bf16 noise does not
    decide a run. A per-token bound alone sat at that noise (0.15: stock vLLM
    went past it in 2 of 11 runs)."""

    mean: float = 0.075  # the request's mean over its tokens
    max: float = 0.3  # any one token

    @property
    def tie_gap(self) -> float:
        """Two bf16 engines, each within `max` of the reference on every
        token, can order two tokens differently only below this fp32 gap."""
        return 2 * self.max


def logprob_deltas(lp: torch.Tensor, out: dict) -> list[float]:
    """|served logprob - reference logprob| of each token the server chose
    (`lp`: `HFReference.logprobs` of the same request and tokens)."""
    return [abs(v - float(lp[i, t])) for i, (t, v) in
            enumerate(zip(out["token_ids"], out["logprobs"], strict=True))]


def adapter_effect(ref: HFReference, req: Request, token_ids: list[int],
                   with_lora: torch.Tensor) -> float:
    """Mean |logprob with the adapter - without it| on `token_ids`
    (`with_lora`: `ref.logprobs(req, token_ids)`): what a server that dropped
    the adapter would be off by."""
    base = ref.logprobs(Request(req.prompt_ids), token_ids)
    return float(sum(abs(with_lora[i, t] - base[i, t]) for i, t in enumerate(token_ids))
                 / len(token_ids))


def bf16_problems(name: str, deltas: list[float], tol: Bf16Tolerance) -> list[str]:
    """Why `deltas` (one request's, from `logprob_deltas`) are not bf16 noise."""
    problems = []
    mean, worst = sum(deltas) / len(deltas), max(deltas)
    if mean > tol.mean:
        problems.append(f"{name}: mean logprob delta {mean:.3f} > {tol.mean}")
    if worst > tol.max:
        problems.append(f"{name}: logprob off by {worst:.3f} at token "
                        f"{deltas.index(worst)} (> {tol.max})")
    return problems


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def mismatches(ref: HFReference, req: Request, out: dict, num_tokens: int,
               atol: float = 1e-4) -> list[str]:
    """Where vLLM's greedy output disagrees with the reference.

    The output must have `num_tokens` tokens (requests run with ignore_eos);
    a token must be the reference's argmax unless the two are within `atol`
    (a near tie), and its logprob must match within `atol`.
    """
    if len(out["token_ids"]) != num_tokens:
        return [f"{len(out['token_ids'])} tokens, expected {num_tokens}"]
    lp = ref.logprobs(req, out["token_ids"])
    problems = []
    for i, (tok, vlp) in enumerate(zip(out["token_ids"], out["logprobs"], strict=True)):
        best = int(lp[i].argmax())
        if tok != best and lp[i, best] - lp[i, tok] > atol:
            problems.append(f"step {i}: token {tok} but reference argmax {best} "
                            f"(gap {float(lp[i, best] - lp[i, tok]):.3g})")
        if abs(vlp - float(lp[i, tok])) > atol:
            problems.append(f"step {i}: logprob {vlp:.6f} vs reference {float(lp[i, tok]):.6f}")
    return problems
