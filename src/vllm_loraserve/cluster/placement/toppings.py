"""Toppings' rank-aware request routing (Toppings §5, Algorithm 1).

For a new request, every candidate engine gets a cost score from the step
model: the extra prefill time of its queue plus the request, amortised over
an average response length, plus the extra decode step time of everything it
holds (running and queued) plus the request; a decode step time above the
SLO adds a large penalty. The score is multiplied by the engine's request
count and the cheapest engine wins (ties: lowest index).

Engines are seen through aggregates (`EngineView`), which is all the linear
step model needs, so a score costs O(1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_loraserve.perf.model import StepModel

SLO_PENALTY = 1e6  # seconds: dominates any real cost, keeps the order among violators


@dataclass(frozen=True)
class EngineView:
    """Aggregates of an engine's requests. Running: decoding or prefilling;
    queued: waiting for admission. `*_lora` is the kernel's LoRA term of the
    queued prompts (mbgmv: sum of prompt tokens x rank)."""

    running: int = 0
    running_rank_sum: int = 0
    running_rank_max: int = 0
    queued: int = 0
    queued_rank_sum: int = 0
    queued_rank_max: int = 0
    queued_prompt_tokens: int = 0
    queued_prompt_lora: float = 0.0


class ToppingsRouter:
    name = "toppings"

    def __init__(self, model: StepModel, tbt_slo_s: float, avg_response_len: float) -> None:
        self.model, self.slo, self.avg_len = model, tbt_slo_s, max(1.0, avg_response_len)

    def _decode_time(self, n: int, rank_sum: int, rank_max: int) -> float:
        lora = rank_sum if self.model.kind == "mbgmv" else n * rank_max
        return self.model.time(0, n, lora) if n else 0.0

    def cost(self, rank: int, prompt_len: int, v: EngineView) -> float:
        m = self.model
        if m.kind == "mbgmv":
            d_pre_lora = prompt_len * rank
        else:  # padded to the largest rank: the queue's prompts pay the new maximum too
            new_max = max(v.queued_rank_max, rank)
            d_pre_lora = ((v.queued_prompt_tokens + prompt_len) * new_max
                          - v.queued_prompt_tokens * v.queued_rank_max)
        d_prefill = m.coef["prefill_tokens"] * prompt_len + m.coef["lora"] * d_pre_lora
        n = v.running + v.queued
        rsum = v.running_rank_sum + v.queued_rank_sum
        rmax = max(v.running_rank_max, v.queued_rank_max)
        dec_after = self._decode_time(n + 1, rsum + rank, max(rmax, rank))
        score = d_prefill / self.avg_len + dec_after - self._decode_time(n, rsum, rmax)
        if dec_after > self.slo:
            score += SLO_PENALTY
        return score * n

    def route(self, rank: int, prompt_len: int, candidates: Sequence[int],
              views: Mapping[int, EngineView]) -> int:
        return min(candidates, key=lambda e: (self.cost(rank, prompt_len, views[e]), e))
