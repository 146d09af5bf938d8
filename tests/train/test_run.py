"""`loraserve train`'s loop: a run that ends inside an adapter's
accumulation applies what it holds, and says so."""

from __future__ import annotations

import os

from safetensors.torch import load_file

from tests.train.helpers import write_data
from vllm_loraserve.train.config import AdapterTrainConfig, OptimizerConfig, TrainConfig
from vllm_loraserve.train.run import run_training


def test_run_ending_mid_accumulation_applies_it(tiny_assets, tmp_path, capsys):
    data = write_data(str(tmp_path / "a.jsonl"), 8, seed=0)
    adapter = AdapterTrainConfig(name="a", rank=8, alpha=16, data=data, samples_per_step=4,
                                 optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    # 3 samples, never the 4 the adapter steps on: only the end of the run applies them
    cfg = TrainConfig(adapters=(adapter,), steps=1, batch_size=3)
    out = run_training(os.path.join(tiny_assets, "model"), cfg, str(tmp_path / "out"))
    assert "applied the partial accumulation of a (3 of 4 samples)" in capsys.readouterr().out
    weights = load_file(os.path.join(out["a"], "adapter_model.safetensors"))
    lora_b = [t for k, t in weights.items() if "lora_B" in k]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)  # PEFT starts B at zero
