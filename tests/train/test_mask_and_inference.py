"""ALoRA's adapter mask (a sample's weighted mix of adapters: its gradient
splits by the weights) and inference samples in the training batch
(generation from the prefill KV, or from a fresh prefill), checked against
HF + PEFT."""

from __future__ import annotations

import os

import torch

from tests.train.helpers import model_and_tokenizer, sample_loss, write_data, write_init
from vllm_loraserve.train.config import AdapterTrainConfig, OptimizerConfig
from vllm_loraserve.train.data import InferenceSample, encode
from vllm_loraserve.train.trainer import MultiAdapterTrainer

TARGETS = ("q_proj", "v_proj", "down_proj")


def _trainer(model_dir, tmp, inits, sps=100, lr=0.1):
    data = write_data(os.path.join(tmp, "d.jsonl"), 4, seed=0)
    configs = [AdapterTrainConfig(name=n, rank=r, alpha=2 * r, data=data, target_modules=TARGETS,
                                  init_from=path, samples_per_step=sps,
                                  optimizer=OptimizerConfig(kind="sgd", lr=lr))
               for n, (r, path) in inits.items()]
    model, tok = model_and_tokenizer(model_dir)
    return MultiAdapterTrainer(model, configs, pad_id=tok.pad_token_id, eos_id=None), tok


def _grads(trainer, name):
    return {p: (a.clone(), b.clone()) for p, (a, b) in trainer.params[name].grads().items()}


def test_mask_splits_gradient_by_weights(tiny_assets, tmp_path):
    """Adapters a and b with the same weights: a sample mixing them 1:3 has
    the output of either alone, and its gradient reaches a and b as 1/4 and
    3/4 of the gradient a one-hot sample gives."""
    model_dir = os.path.join(tiny_assets, "model")
    init = write_init(model_dir, str(tmp_path / "init"), 16, 32, TARGETS, seed=3)
    mixed, tok = _trainer(model_dir, str(tmp_path), {"a": (16, init), "b": (16, init)})
    solo, _ = _trainer(model_dir, str(tmp_path), {"a": (16, init)})
    s = encode(tok, "the model reads a prompt", "and writes", {"a": 0.25, "b": 0.75})
    r_mixed = mixed.step([s])
    r_solo = solo.step([encode(tok, "the model reads a prompt", "and writes", {"a": 1.0})])
    assert abs(r_mixed.losses["a"] - r_solo.losses["a"]) < 1e-5
    g = _grads(solo, "a")
    for name, w in (("a", 0.25), ("b", 0.75)):
        got = _grads(mixed, name)
        for path, (da, db) in g.items():
            torch.testing.assert_close(got[path][0], w * da, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[path][1], w * db, atol=1e-6, rtol=1e-5)
    assert float(g["model.layers.0.self_attn.q_proj"][1].abs().max()) > 1e-3


def test_mask_mixes_outputs(tiny_assets, tmp_path):
    """With different weights, the mixed sample's loss is that of the
    weighted delta computed densely with PEFT-format weights."""
    model_dir = os.path.join(tiny_assets, "model")
    inits = {"a": (8, write_init(model_dir, str(tmp_path / "ia"), 8, 16, TARGETS, seed=4)),
             "b": (32, write_init(model_dir, str(tmp_path / "ib"), 32, 64, TARGETS, seed=5))}
    trainer, tok = _trainer(model_dir, str(tmp_path), inits)
    s = encode(tok, "tell me a story", "about a cat", {"a": 0.4, "b": 0.6})
    got = trainer.step([s]).losses["a"]

    model, _ = model_and_tokenizer(model_dir)
    deltas = {n: trainer.adapter_weights(n) for n in inits}

    def hook(path):
        def f(mod, inp, out):
            x = inp[0]
            return out + sum(w * 2.0 * (x @ deltas[n][path][0].T @ deltas[n][path][1].T)
                             for n, w in s.mix.items())
        return f
    for path, mod in model.named_modules():
        if path in deltas["a"]:
            mod.register_forward_hook(hook(path))
    with torch.no_grad():
        want = sample_loss(model(input_ids=torch.tensor([s.input_ids])).logits[0],
                           torch.tensor(s.labels))
    assert abs(got - float(want)) < 1e-5


def _peft_greedy(model_dir, adapter_dir, ids, n):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_inference_samples_generate_like_peft(tiny_assets, tmp_path):
    """Inference samples ride with training samples of other adapters; no
    update happens in the step, so KV reuse and a fresh prefill must both
    give PEFT's greedy tokens."""
    model_dir = os.path.join(tiny_assets, "model")
    inits = {"a": (8, write_init(model_dir, str(tmp_path / "ia"), 8, 16, TARGETS, seed=6)),
             "b": (128, write_init(model_dir, str(tmp_path / "ib"), 128, 256, TARGETS, seed=7))}
    prompts = ["what is the weather like", "write a poem about the sea today please"]
    outs = []
    for reuse in (True, False):
        trainer, tok = _trainer(model_dir, str(tmp_path), inits)
        train = [encode(tok, "a long training prompt that is longer than the others here",
                        "answer", {"b": 1.0})]
        infer = [InferenceSample(tuple(tok(p)["input_ids"]), {n: 1.0}, max_new_tokens=6)
                 for p, n in zip(prompts, ("a", "b"), strict=True)]
        r = trainer.step(train, infer, reuse_kv=reuse)
        assert r.updated == [] and r.generated_tokens == 12
        outs.append(r.generated)
    assert outs[0] == outs[1]
    for s, got in zip(infer, outs[0], strict=True):
        name = next(iter(s.mix))
        assert got == _peft_greedy(model_dir, inits[name][1], list(s.input_ids), 6)


def test_fresh_prefill_after_update_uses_new_weights(tiny_assets, tmp_path):
    """With reuse_kv=False the tokens come from the updated adapter only."""
    from vllm_loraserve.adapters.peft import write_adapter

    model_dir = os.path.join(tiny_assets, "model")
    inits = {"a": (8, write_init(model_dir, str(tmp_path / "ia"), 8, 16, TARGETS, seed=8))}
    trainer, tok = _trainer(model_dir, str(tmp_path), inits, sps=1, lr=2.0)
    train = [encode(tok, "the cat", "sails on the sea", {"a": 1.0})]
    prompt = tuple(tok("the cat")["input_ids"])
    r = trainer.step(train, [InferenceSample(prompt, {"a": 1.0}, max_new_tokens=5)],
                     reuse_kv=False)
    assert r.updated == ["a"]
    write_adapter(str(tmp_path / "new"), trainer.adapter_weights("a"), rank=8, alpha=16,
                  base_model="test")
    assert r.generated[0] == _peft_greedy(model_dir, str(tmp_path / "new"), list(prompt), 5)
