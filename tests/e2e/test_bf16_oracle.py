"""The GPU pool test's oracle (tests/gpu/test_pool_gpu.py), checked on CPU:
it must admit bf16 noise and catch a server that drops an adapter, on that
test's own model, adapters and requests."""

from __future__ import annotations

import pytest
import torch

from ..gpu.case import MAX_TOKENS, build_case
from .reference import Bf16Tolerance, HFReference, Request, bf16_problems, logprob_deltas

TOL = Bf16Tolerance()


def _chosen(lp: torch.Tensor, tokens: list[int]) -> list[float]:
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per request: the fp32 reference's greedy tokens and its logprobs on
    them, and the logprobs of those tokens from a bf16 model with the adapter
    and from the fp32 model without it (a server that dropped the adapter)."""
    model, reqs = build_case(tmp_path_factory.mktemp("case"))
    ref, bf16 = HFReference(model), HFReference(model, dtype=torch.bfloat16)
    out = []
    for req in reqs:
        tokens: list[int] = []
        for _ in range(MAX_TOKENS):
            tokens.append(int(ref.logprobs(req, [*tokens, 0])[-1].argmax()))
        out.append((req, tokens, ref.logprobs(req, tokens),
                    _chosen(bf16.logprobs(req, tokens).float(), tokens),
                    _chosen(ref.logprobs(Request(req.prompt_ids), tokens), tokens)))
    return out


def test_bf16_noise_is_within_the_tolerance(served):
    problems = [p for req, tokens, lp, bf16, _ in served
                for p in bf16_problems(req.lora_name or "base", logprob_deltas(
                    lp, {"token_ids": tokens, "logprobs": bf16}), TOL)]
    assert not problems, problems


def test_a_dropped_adapter_is_caught_on_every_request(served):
    def problems(name, tokens, lp, dropped):
        return bf16_problems(name, logprob_deltas(lp, {"token_ids": tokens,
                                                       "logprobs": dropped}), TOL)

    missed = [req.lora_name for req, tokens, lp, _, dropped in served
              if req.lora_name and not problems(req.lora_name, tokens, lp, dropped)]
    assert not missed, f"the oracle passes these adapters' requests without them: {missed}"
    base = [problems("base", tokens, lp, dropped) for req, tokens, lp, _, dropped in served
            if req.lora_name is None]
    assert base and not any(base), base  # base requests: dropping nothing is exact
