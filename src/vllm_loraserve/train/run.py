"""`loraserve train`: the training loop around the trainer, with progress,
saving and publishing."""

from __future__ import annotations

import os
import signal
import time

import torch
from tqdm import tqdm

from vllm_loraserve.train.config import TrainConfig
from vllm_loraserve.train.data import adapter_stream
from vllm_loraserve.train.publish import publish, save_adapter, save_versions
from vllm_loraserve.train.trainer import MultiAdapterTrainer


def run_training(model_dir: str, cfg: TrainConfig, out_dir: str, device: str = "cpu",
                 dtype: str = "float32") -> dict[str, str]:
    """Train and write `out_dir/<name>/` per adapter (PEFT); versions go to
    `out_dir/<name>@<step>/` every `save_every` / `publish.every` steps and
    on SIGUSR1 (publish on demand). Returns name -> final directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.to(device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = MultiAdapterTrainer(model, cfg.adapters, pad_id=pad, eos_id=tok.eos_token_id,
                                  kernel=cfg.kernel, seed=cfg.seed)
    streams = {a.name: adapter_stream(tok, a.name, a.data) for a in cfg.adapters}
    base_model = os.path.abspath(model_dir)
    on_demand = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: on_demand.append(True))
    samples, start = 0, time.perf_counter()
    try:
        with tqdm(range(1, cfg.steps + 1), desc="train", unit="step") as bar:
            for step in bar:
                batch = trainer.compose(streams, cfg.batch_size)
                result = trainer.step(batch)
                samples += len(batch)
                if step == cfg.steps and (pending := trainer.flush()):
                    bar.write("last step: applied the partial accumulation of " + ", ".join(
                        f"{n} ({k} of {trainer.configs[n].samples_per_step} samples)"
                        for n, k in sorted(pending.items())))
                bar.set_postfix({**{n: f"{v:.3f}" for n, v in sorted(result.losses.items())},
                                 "samples/s": f"{samples / (time.perf_counter() - start):.1f}"})
                due_save = cfg.save_every and step % cfg.save_every == 0
                due_publish = (cfg.publish.every and step % cfg.publish.every == 0) or on_demand
                if due_save or due_publish or step == cfg.steps:
                    versions = save_versions(trainer, out_dir, step, base_model)
                    if (due_publish or step == cfg.steps) and \
                            (cfg.publish.servers or cfg.publish.router):
                        publish(versions, cfg.publish)
                        bar.write(f"step {step}: published {sorted(versions)}")
                    on_demand.clear()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return {n: save_adapter(trainer, n, os.path.join(out_dir, n), base_model)
            for n in trainer.configs}
