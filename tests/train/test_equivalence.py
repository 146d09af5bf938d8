"""Adapters of ranks 8, 32 and 128 trained together in mixed batches end
with the weights each reaches trained alone with PEFT on its own samples in
the same order (ALoRA §5.1, made exact): sgd to fp32 rounding, adamw within
a stated tolerance; different samples_per_step per adapter; Llama and Qwen2."""

from __future__ import annotations

import os

import pytest
import torch

from tests.train.helpers import (
    counted,
    model_and_tokenizer,
    peft_solo,
    write_data,
    write_init,
)
from vllm_loraserve.adapters.peft import load_adapter
from vllm_loraserve.train.config import AdapterTrainConfig, OptimizerConfig
from vllm_loraserve.train.data import adapter_stream
from vllm_loraserve.train.trainer import MultiAdapterTrainer

ADAPTERS = [  # name, rank, targets, samples_per_step
    ("small", 8, ("q_proj", "v_proj"), 2),
    ("mid", 32, ("q_proj", "k_proj", "v_proj", "o_proj"), 3),
    ("large", 128, ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4),
]
# adamw normalises each element's step by its gradient's size: where a
# gradient is at rounding level, a different summation order flips the step's
# sign, so single elements may differ by up to lr per step; the rest agree to
# fp32 rounding (checked on the mean difference).
TOLERANCE = {"sgd": dict(atol=2e-6, rtol=1e-5), "adamw": dict(atol=2e-3, rtol=1e-4)}
MEAN_TOLERANCE = {"sgd": 1e-7, "adamw": 1e-6}
OPTIMIZERS = {"sgd": dict(lr=0.1), "adamw": dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8,
                                                 weight_decay=0.01)}


def _configs(model_dir, tmp, optimizer, use_rslora=False):
    out = []
    for i, (name, rank, targets, sps) in enumerate(ADAPTERS):
        alpha = 2 * rank**0.5 if use_rslora else 2 * rank  # scaling 2 either way
        data = write_data(os.path.join(tmp, f"{name}.jsonl"), 12, seed=i)
        init = write_init(model_dir, os.path.join(tmp, f"init-{name}"), rank, alpha,
                          targets, seed=10 + i, use_rslora=use_rslora)
        opt = OptimizerConfig(kind=optimizer, **OPTIMIZERS[optimizer])
        out.append(AdapterTrainConfig(name=name, rank=rank, alpha=alpha, data=data,
                                      target_modules=targets, use_rslora=use_rslora,
                                      init_from=init, optimizer=opt, samples_per_step=sps))
    return out


def _train_mixed(model_dir, configs, steps, batch_size):
    model, tok = model_and_tokenizer(model_dir)
    trainer = MultiAdapterTrainer(model, configs, pad_id=tok.pad_token_id, seed=0)
    used = {c.name: [] for c in configs}
    streams = {c.name: counted(adapter_stream(tok, c.name, c.data), used[c.name])
               for c in configs}
    stepped = {c.name: 0 for c in configs}
    for _ in range(steps):
        batch = trainer.compose(streams, batch_size)
        assert len({n for s in batch for n in s.mix}) > 1  # batches really mix adapters
        for name in trainer.step(batch).updated:
            stepped[name] += 1
    return trainer, tok, used, stepped


@pytest.mark.parametrize("arch, optimizer", [("llama", "sgd"), ("llama", "adamw"),
                                             ("qwen2", "sgd")])
def test_mixed_training_matches_peft_solo(tiny_assets, qwen_assets, tmp_path, arch, optimizer):
    model_dir = os.path.join(tiny_assets if arch == "llama" else qwen_assets, "model")
    configs = _configs(model_dir, str(tmp_path), optimizer, use_rslora=arch == "qwen2")
    trainer, tok, used, stepped = _train_mixed(model_dir, configs, steps=10, batch_size=5)
    assert all(n >= 2 for n in stepped.values()), stepped
    assert len(used["small"]) > 12  # one adapter went past an epoch of its file
    for c in configs:
        n_done = stepped[c.name] * c.samples_per_step
        assert len(used[c.name]) >= n_done
        want = peft_solo(model_dir, c.init_from, used[c.name][:n_done], optimizer,
                         OPTIMIZERS[optimizer], c.samples_per_step)
        got = trainer.adapter_weights(c.name)
        assert got.keys() == want.keys()
        for path, (a, b) in want.items():
            torch.testing.assert_close(got[path][0], a, **TOLERANCE[optimizer])
            torch.testing.assert_close(got[path][1], b, **TOLERANCE[optimizer])
            for g, w in zip(got[path], (a, b), strict=True):
                assert float((g - w).abs().mean()) < MEAN_TOLERANCE[optimizer]
        _, start = load_adapter(c.init_from)
        moved = max(float((want[p][1] - start[p][1].float()).abs().max()) for p in want)
        assert moved > 1e-3  # training moved the weights well beyond the tolerance


def test_partial_accumulation_is_applied_at_the_end(tiny_assets, tmp_path):
    """`flush` steps each adapter on the samples it holds short of its
    samples_per_step, on their mean gradient: a solo PEFT run whose last
    micro-batch is that short ends at the same weights."""
    model_dir = os.path.join(tiny_assets, "model")
    configs = _configs(model_dir, str(tmp_path), "sgd")
    trainer, _, used, stepped = _train_mixed(model_dir, configs, steps=5, batch_size=4)
    pending = {c.name: len(used[c.name]) - stepped[c.name] * c.samples_per_step
               for c in configs}
    assert pending == {"small": 0, "mid": 2, "large": 1}  # two short, of different sizes
    assert trainer.flush() == {"mid": 2, "large": 1}
    assert trainer.flush() == {}  # nothing held any more
    for c in configs[1:]:
        want = peft_solo(model_dir, c.init_from, used[c.name], "sgd", OPTIMIZERS["sgd"],
                         c.samples_per_step)
        got = trainer.adapter_weights(c.name)
        for path, (a, b) in want.items():
            torch.testing.assert_close(got[path][0], a, **TOLERANCE["sgd"])
            torch.testing.assert_close(got[path][1], b, **TOLERANCE["sgd"])
