"""One mixed batch: training samples first, then inference samples (as
ALoRA lays them out), right-padded into one tensor, with the per-token
adapter routing every wrapped layer reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_loraserve.train.data import IGNORE, InferenceSample, Sample
from vllm_loraserve.train.lora import Routing


@dataclass(frozen=True)
class MixedBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]; 0 on padding
    labels: torch.Tensor  # [B, T]; IGNORE on prompts, padding and inference samples
    lengths: list[int]
    num_train: int
    routing: Routing

    @classmethod
    def build(cls, train: Sequence[Sample], infer: Sequence[InferenceSample],
              slot_of: Mapping[str, int], pad_id: int, device: torch.device) -> MixedBatch:
        seqs = [s.input_ids for s in train] + [s.input_ids for s in infer]
        mixes = [s.mix for s in train] + [s.mix for s in infer]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        token_mixes: list[dict[int, float] | None] = []
        trains = []
        for i, (seq, mix) in enumerate(zip(seqs, mixes, strict=True)):
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
            if i < len(train):
                labels[i, :len(seq)] = torch.tensor(train[i].labels)
            slots = {slot_of[n]: w for n, w in mix.items() if w > 0}
            token_mixes += [slots] * len(seq) + [None] * (width - len(seq))
            trains += [i < len(train)] * width
        return cls(ids.to(device), mask.to(device), labels.to(device),
                   [len(s) for s in seqs], len(train),
                   Routing.build(token_mixes, trains, device))


def decode_routing(infer: Sequence[InferenceSample], slot_of: Mapping[str, int],
                   device: torch.device) -> Routing:
    """One token per inference sample (a decode step), no training rows."""
    mixes = [{slot_of[n]: w for n, w in s.mix.items() if w > 0} for s in infer]
    return Routing.build(mixes, [False] * len(infer), device)
