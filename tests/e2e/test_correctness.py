"""vLLM + plugin == HF transformers + PEFT (fp32), in mixed batches.

Each batch mixes adapters of every rank with requests that have no adapter,
and uses every LoRA slot, so the last slot is occupied: the case where
vLLM's CPU ops apply an adapter to no-adapter tokens (vllm#48421). The stock
run pins that this batch really triggers the bug, so the plugin run can only
pass because of the plugin's fix.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from vllm_loraserve.adapters.peft import (
    AdapterError,
    ModelLoRAInfo,
    check_against_model,
    inspect_adapter,
)
from vllm_loraserve.demo.assets import ALL_TARGETS, make_adapter, module_dims

from .reference import IN_PROCESS, HFReference, Request, mismatches, run_vllm

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    first_regular = 8  # after the special tokens
    return [rng.randrange(first_regular, vocab) for _ in range(rng.randint(4, 40))]


def _tokenizer_size(model_dir: str) -> int:
    return len(json.load(open(os.path.join(model_dir, "tokenizer.json")))["model"]["vocab"])


@pytest.fixture(scope="module")
def llama_case(tiny_assets, tmp_path_factory):
    model = os.path.join(tiny_assets, "model")
    records = json.load(open(os.path.join(tiny_assets, "adapters.json")))
    adapters = [(r["name"], os.path.join(tiny_assets, r["path"])) for r in records]
    # Llama also takes LoRA on the output head and the input embedding.
    head = str(tmp_path_factory.mktemp("head") / "head-embed-r16")
    make_adapter(head, module_dims(model, ("lm_head", "embed_tokens", "v_proj")), rank=16,
                 alpha=8, seed=11, base_model="tiny")
    adapters.append(("head-embed-r16", head))
    rng, vocab = random.Random(0), _tokenizer_size(model)
    reqs = []
    for i in range(2):
        reqs += [Request(_prompt(rng, vocab), name, path) for name, path in adapters]
        reqs.insert(i * 3, Request(_prompt(rng, vocab)))
    reqs.append(Request(_prompt(rng, vocab)))
    # 7 adapters over 5 slots: all slots busy, the others wait for a free one.
    engine = {"max_loras": 5, "max_lora_rank": 128, "max_cpu_loras": 7, "max_num_seqs": 32}
    return model, reqs, engine


def _check_all(ref, reqs, outs, only=lambda r: True):
    problems = []
    for req, out in zip(reqs, outs, strict=True):
        if only(req):
            problems += [f"{req.lora_name or 'base'}: {p}"
                         for p in mismatches(ref, req, out, MAX_TOKENS)]
    return problems


def test_vllm_slots_match_hf_peft_on_every_rank_with_base_requests(llama_case, tmp_path):
    """`--loraserve-pool vllm`: vLLM's own slots, with the plugin's CPU fix."""
    model, reqs, engine = llama_case
    run = run_vllm(tmp_path, model, reqs,
                   {**engine, "additional_config": {"loraserve": {"pool": "vllm"}}}, MAX_TOKENS,
                   env=IN_PROCESS)
    problems = _check_all(HFReference(model), reqs, run["outputs"])
    assert not problems, "\n".join(problems)
    _check_module_table(model, run["lora_modules"], ALL_TARGETS + ("lm_head", "embed_tokens"))
    ranks = {int(r.lora_name.rsplit("-r", 1)[1]) for r in reqs if r.lora_name}
    assert ranks == {8, 16, 32, 64, 128} and any(r.lora_name == "head-embed-r16" for r in reqs)
    assert sum(r.lora_name is None for r in reqs) == 3


def test_stock_vllm_cpu_applies_an_adapter_to_base_requests(llama_case, tmp_path):
    """The same batch without the plugin: adapter requests are right, base
    requests are not. If vLLM fixes vllm#48421 this fails: drop worker/cpu_ops.py."""
    model, reqs, engine = llama_case
    outs = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, env=IN_PROCESS)["outputs"]
    ref = HFReference(model)
    assert not _check_all(ref, reqs, outs, only=lambda r: r.lora_name is not None)
    assert _check_all(ref, reqs, outs, only=lambda r: r.lora_name is None)


def test_other_architecture_rslora_partial_targets(qwen_assets, tmp_path_factory, tmp_path):
    """Qwen2 (biased q/k/v), rsLoRA, partial target modules, alpha below and
    above the rank, in one batch with base requests."""
    model = os.path.join(qwen_assets, "model")
    root = tmp_path_factory.mktemp("qwen-adapters")
    variants = {
        "rs-r8": dict(rank=8, alpha=16, use_rslora=True,
                      targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj")),
        "qv-r32": dict(rank=32, alpha=8, targets=("q_proj", "v_proj")),
        "mlp-r16": dict(rank=16, alpha=48, targets=("o_proj", "gate_proj", "down_proj")),
    }
    paths = {}
    for seed, (name, v) in enumerate(variants.items()):
        paths[name] = str(root / name)
        make_adapter(paths[name], module_dims(model, v["targets"]), rank=v["rank"],
                     alpha=v["alpha"], seed=seed, base_model="qwen2-tiny",
                     use_rslora=v.get("use_rslora", False))
    rng, vocab = random.Random(1), _tokenizer_size(model)
    reqs = [Request(_prompt(rng, vocab), name, path)
            for _ in range(2) for name, path in paths.items()]
    reqs += [Request(_prompt(rng, vocab)) for _ in range(2)]
    rng.shuffle(reqs)
    engine = {"max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 3, "max_num_seqs": 16,
              "additional_config": {"loraserve": {}}}
    # Every adapter in host memory first, so all three are admitted in one step.
    run = run_vllm(tmp_path, model, reqs, engine, MAX_TOKENS, env=IN_PROCESS, read_ahead=True)
    problems = _check_all(HFReference(model), reqs, run["outputs"])
    assert not problems, "\n".join(problems)
    assert run["residency"]["pool"]["peak_batch_adapters"] == 3  # the paged pool served them
    # vLLM's Qwen2 takes no LoRA on lm_head / embed_tokens: such adapters are refused.
    _check_module_table(model, run["lora_modules"], ALL_TARGETS)
    head = str(tmp_path_factory.mktemp("qwen-head") / "head")
    make_adapter(head, module_dims(model, ("lm_head",)), rank=8, alpha=8, seed=0, base_model="q")
    info = ModelLoRAInfo.from_wire(run["lora_modules"], max_rank=32)
    with pytest.raises(AdapterError, match=r"unsupported target module\(s\) \['lm_head'\]"):
        check_against_model(inspect_adapter(head), info)


def _check_module_table(model: str, table: dict, expected: tuple[str, ...]) -> None:
    """The workers' table (packed qkv/gate_up split back into PEFT names) has
    exactly the HF model's module paths and shapes for every module vLLM adapts."""
    assert set(table["shapes"]) == set(expected)
    hf = module_dims(model, expected)
    assert set(table["modules"]) == set(hf)
    for name, shapes in table["shapes"].items():
        assert {tuple(s) for s in shapes} == {v for k, v in hf.items()
                                              if k.rsplit(".", 1)[-1] == name}, name
