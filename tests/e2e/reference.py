"""HF transformers + PEFT in fp32: the reference vLLM is compared with."""

from __future__ import annotations

import json
import os
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
    """Teacher-forced log-probabilities of a token sequence under base or adapter."""

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).to(device).eval()
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
