"""The GPU pool test's oracle (tests/gpu/test_pool_gpu.py), checked on CPU:
it must admit bf16 noise and catch a server that drops an adapter, on that
test's own model, adapters and requests."""

from __future__ import annotations

import pytest
import torch

from ..gpu.case import MAX_TOKENS, build_case
from .reference import Bf16Tolerance, HFReference, Request, bf16_problems, logprob_deltas

TOL = Bf16Tolerance()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per request: the fp32 reference's greedy tokens, and the logprobs of
    those tokens from a bf16 model with the adapter and from the fp32 model
    without it (a server that dropped the adapter)."""
    model, reqs = build_case(tmp_path_factory.mktemp("case"))
    ref, bf16 = HFReference(model), HFReference(model, dtype=torch.bfloat16)
    out = []
    for req in reqs:
        tokens: list[int] = []
        for _ in range(MAX_TOKENS):
            tokens.append(int(ref.logprobs(req, [*tokens, 0])[-1].argmax()))

        def chosen(lp: torch.Tensor) -> list[float]:
            return [float(lp[i, t]) for i, t in enumerate(tokens)]  # noqa: B023

        dropped = chosen(ref.logprobs(Request(req.prompt_ids), tokens))
        out.append((req, tokens, chosen(bf16.logprobs(req, tokens).float()), dropped))
    return ref, out


def test_bf16_noise_is_within_the_tolerance(served):
    ref, out = served
    problems = [p for req, tokens, bf16, _ in out
                for p in bf16_problems(req.lora_name or "base", logprob_deltas(
                    ref, req, {"token_ids": tokens, "logprobs": bf16}), TOL)]
    assert not problems, problems


def test_a_dropped_adapter_is_caught_on_every_request(served):
    ref, out = served
    missed = [req.lora_name for req, tokens, _, dropped in out if req.lora_name and not
              bf16_problems(req.lora_name, logprob_deltas(
                  ref, req, {"token_ids": tokens, "logprobs": dropped}), TOL)]
    assert not missed, f"the oracle passes these adapters' requests without them: {missed}"
    base = [bf16_problems("base", logprob_deltas(ref, req, {"token_ids": t, "logprobs": d}),
                          TOL) for req, t, _, d in out if req.lora_name is None]
    assert base and not any(base), base  # base requests: dropping nothing is exact
