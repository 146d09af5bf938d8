"""The GPU pool test's model, adapters and requests (tests/gpu/test_pool_gpu.py),
built here so a CPU test can check that its oracle sees every adapter
(tests/e2e/test_bf16_oracle.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from vllm_loraserve.demo.assets import ALL_TARGETS, build_model, make_adapter, module_dims

from ..e2e.reference import Request

MAX_TOKENS = 16
ADAPTERS = [(8, ALL_TARGETS), (16, ("q_proj", "v_proj")), (32, ALL_TARGETS),
            (64, ("o_proj", "down_proj")), (128, ALL_TARGETS), (24, ("gate_proj", "up_proj")),
            (8, ("q_proj", "k_proj", "v_proj", "o_proj")), (128, ("q_proj", "v_proj"))]
# Llama-3-8B's layer shapes (GQA: k/v out 1024; gate/up out 14336, down in
# 14336), adapters on all linear layers at the ranks users train.
LLAMA3_ADAPTERS = [(16, ALL_TARGETS), (32, ALL_TARGETS), (64, ALL_TARGETS),
                   (16, ALL_TARGETS), (64, ("q_proj", "k_proj", "v_proj", "o_proj")),
                   (32, ("gate_proj", "up_proj", "down_proj"))]


def build_case(root: Path, preset: str = "small",
               adapters: list = ADAPTERS) -> tuple[str, list[Request]]:
    """The model's path and 3 requests per adapter plus 4 without one, shuffled."""
    model = str(root / "model")
    build_model(model, preset=preset, seed=3)
    reqs = []
    vocab = len(json.load(open(os.path.join(model, "tokenizer.json")))["model"]["vocab"])
    rng = random.Random(0)
    for i, (rank, targets) in enumerate(adapters):
        path = str(root / f"a{i}-r{rank}")
        make_adapter(path, module_dims(model, targets), rank=rank, alpha=2 * rank, seed=i,
                     base_model="small")
        reqs += [Request([rng.randrange(8, vocab) for _ in range(rng.randint(8, 120))],
                         f"a{i}-r{rank}", path) for _ in range(3)]
    reqs += [Request([rng.randrange(8, vocab) for _ in range(30)]) for _ in range(4)]
    rng.shuffle(reqs)
    return model, reqs
