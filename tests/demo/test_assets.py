"""The embedded default: deterministic, real PEFT, all five ranks."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from vllm_loraserve.adapters.peft import inspect_adapter
from vllm_loraserve.demo.assets import (
    ALL_TARGETS,
    DEMO_RANKS,
    PRESETS,
    build_assets,
    build_model,
)


def _same_tree(a: str, b: str) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(
        _same_tree(os.path.join(a, d), os.path.join(b, d)) for d in cmp.common_dirs)


def test_same_seed_same_bytes(tiny_assets, tmp_path):
    build_assets(str(tmp_path), num_adapters=6)
    assert _same_tree(tiny_assets, str(tmp_path))


def test_other_seed_other_weights(tiny_assets, tmp_path):
    build_assets(str(tmp_path), num_adapters=1, seed=5)
    a = load_file(os.path.join(tiny_assets, "model", "model.safetensors"))
    b = load_file(os.path.join(tmp_path, "model", "model.safetensors"))
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_adapters_cover_ranks_with_alpha_not_rank(tiny_assets):
    records = json.load(open(os.path.join(tiny_assets, "adapters.json")))
    assert [r["rank"] for r in records] == [*DEMO_RANKS, DEMO_RANKS[0]]
    for r in records:
        spec = inspect_adapter(os.path.join(tiny_assets, r["path"]))
        assert spec.rank == r["rank"] and spec.alpha == r["alpha"] != r["rank"]
        assert spec.target_modules == sorted(ALL_TARGETS)
        tensors = load_file(os.path.join(spec.path, "adapter_model.safetensors"))
        assert all(t.abs().sum() > 0 for t in tensors.values())  # A and B non-zero


def test_peft_and_transformers_load_the_assets(tiny_assets):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = os.path.join(tiny_assets, "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    ids = tok("Hello, how are you?", return_tensors="pt").input_ids
    assert tok.unk_token_id not in ids[0].tolist()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
    model = peft.PeftModel.from_pretrained(
        base, os.path.join(tiny_assets, "adapters", "adapter-000-r8"))
    with torch.no_grad():
        lora_logits = model(ids).logits
    assert (base_logits - lora_logits).abs().max() > 0.1  # the adapter matters


TEXTS = ["Hello, how are you?", "Tell me a story\nabout a cat who learned to sail.",
         "def add(a, b):  return a + b", "<|user|>\nList three colours:<|end|>\n<|assistant|>\n"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_auto_tokenizer_tokenizes_as_built(preset, tmp_path, monkeypatch):
    """`AutoTokenizer` (what vLLM, PEFT and the trainer load) encodes and
    decodes text as the tokenizer.json that was built, for every preset:
    transformers 5.x rebuilds a qwen2 model's tokenizer from vocab and merges
    with Qwen2's own pipeline, whatever tokenizer.json says."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    monkeypatch.setitem(PRESETS, preset, dataclasses.replace(PRESETS[preset],
                                                             write_weights=False))
    build_model(str(tmp_path), preset)
    built = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        ids = built.encode(text).ids
        assert auto(text).input_ids == ids, (type(auto).__name__, text)
        assert auto.decode(ids) == built.decode(ids, skip_special_tokens=False) == text
    assert auto.convert_tokens_to_ids("<|user|>") == built.token_to_id("<|user|>")
