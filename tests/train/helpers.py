"""Shared pieces of the training tests: data, init adapters, a PEFT solo run."""

from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F

from vllm_loraserve.demo.assets import make_adapter, module_dims
from vllm_loraserve.train.data import IGNORE

WORDS = ("the model reads a prompt and writes an answer serving many adapters is cheap "
         "ranks differ eight sixteen thirty two red green blue cat sea poem").split()


def write_data(path: str, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))
            completion = " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def write_init(model_dir: str, path: str, rank: int, alpha: float, targets, seed: int,
               use_rslora: bool = False) -> str:
    """A PEFT adapter with non-zero A and B (so both get gradients at once)."""
    make_adapter(path, module_dims(model_dir, tuple(targets)), rank=rank, alpha=alpha,
                 seed=seed, base_model="test", strength=0.3, use_rslora=use_rslora)
    return path


def sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the completion tokens (labels shifted)."""
    lg, lb = logits[:-1].float(), labels[1:]
    return F.cross_entropy(lg, lb, ignore_index=IGNORE, reduction="sum") / (lb != IGNORE).sum()


def peft_solo(model_dir: str, init_dir: str, samples: list, optimizer: str, opt_kwargs: dict,
              samples_per_step: int):
    """Train one adapter alone with PEFT on `samples` in order, micro-batches of
    `samples_per_step` (the last one may be shorter: the mean over its own);
    returns module path -> (A, B)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(params, **opt_kwargs)
    for start in range(0, len(samples), samples_per_step):
        micro = samples[start:start + samples_per_step]
        for s in micro:
            ids = torch.tensor([s.input_ids])
            loss = sample_loss(model(input_ids=ids).logits[0], torch.tensor(s.labels))
            (loss / len(micro)).backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for key, t in get_peft_model_state_dict(model).items():
        module, kind = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        out.setdefault(module, {})[kind] = t.detach()
    return {m: (ab["lora_A"], ab["lora_B"]) for m, ab in out.items()}


def model_and_tokenizer(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(model_dir))


def counted(stream, counter: list):
    for s in stream:
        counter.append(s)
        yield s

