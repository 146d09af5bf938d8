"""Samples: JSONL {"prompt", "completion"} -> token ids with the loss on the
completion only (labels -100 on the prompt, as HF's loss ignores)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

IGNORE = -100


@dataclass(frozen=True)
class Sample:
    """One training sample and the adapters it trains.

    `mix` maps adapter name -> weight (ALoRA's mask row; weights sum to 1).
    The sample's output is the base plus the weighted sum of the adapters'
    deltas, so its gradient reaches adapter i scaled by weight i."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # IGNORE where no loss (prompt)
    mix: Mapping[str, float]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels) or not self.input_ids:
            raise ValueError("input_ids and labels must be non-empty and of one length")
        if not self.mix or abs(sum(self.mix.values()) - 1.0) > 1e-6 or \
                any(w < 0 for w in self.mix.values()):
            raise ValueError(f"a sample's adapter weights must be >= 0 and sum to 1: {self.mix}")
        if all(label == IGNORE for label in self.labels[1:]):
            raise ValueError("a training sample needs at least one completion token")


@dataclass(frozen=True)
class InferenceSample:
    """A prompt that rides in a training batch and is then generated."""

    input_ids: tuple[int, ...]
    mix: Mapping[str, float]
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy


def encode(tokenizer, prompt: str, completion: str, mix: Mapping[str, float]) -> Sample:
    """BOS + prompt, then completion + EOS; the loss covers the completion."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(tuple(p + c), tuple([IGNORE] * len(p) + c), dict(mix))


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i}: not JSON: {e}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or \
                    not isinstance(row.get("completion"), str):
                raise ValueError(f'{path}:{i}: expected {{"prompt": str, "completion": str}}')
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no samples")
    return rows


def adapter_stream(tokenizer, name: str, path: str) -> Iterator[Sample]:
    """The adapter's samples in file order, repeated (epochs)."""
    samples = [encode(tokenizer, r["prompt"], r["completion"], {name: 1.0})
               for r in read_jsonl(path)]
    while True:
        yield from samples
