"""Mixed-batch multi-adapter fine-tuning + inference throughput (issue 10):
this trainer vs PEFT, in one process, on random-weight Llama shapes.

Per step: `--batch` samples, a fraction `--train-frac` of them training
samples (prompt + completion, loss on the completion), the rest inference
samples (prompt, then `--gen-tokens` generated greedily). Adapters of mixed
ranks (8/16/32/64/128 cycling) on the attention projections; each sample
belongs to one adapter (round-robin). The same batch repeats each step; an
adapter's samples_per_step is its training samples per batch times
`--accumulate`, so every adapter's optimizer steps every `--accumulate`
batches, in both modes. Throughput counts, as ALoRA §5.2,
training tokens (prompt + completion of training samples) plus generated
tokens, over the wall time of the timed steps.

Modes:
- `loraserve`: one mixed batch through vllm_loraserve.train (paged
  kernels, per-adapter optimizers, generation from the prefill KV);
- `loraserve-reprefill`: the same, prefilling the inference prompts again
  after the update instead of reusing the mixed batch's KV (what the reuse
  saves, and the one-token staleness it avoids; train/trainer.py);
- `peft-solo`: ALoRA's baseline: PEFT with every adapter loaded, training
  one adapter at a time (a micro-batch = that adapter's training samples of
  the step), then inference through PEFT's mixed-adapter batch generate
  (`adapter_names`, its best inference path; it re-prefills);
- `peft-padded`: all adapters at one rank in one training batch: PEFT
  refuses `adapter_names` in training mode; the probe records its error.

    python benchmarks/train/bench_train.py --tiny            # CPU smoke
    python benchmarks/train/bench_train.py --shape 7b --adapters 32 \\
        --train-frac 0.25 0.5 0.75 --out train-7b.json      # one GPU call
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

RANKS = (8, 16, 32, 64, 128)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 256),
    "1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B
    "7b": (4096, 11008, 32, 32, 32, 32000),  # Llama-2-7B
}


@dataclass(frozen=True)
class Case:
    shape: str
    adapters: int
    train_frac: float
    batch: int
    prompt_len: int
    completion_len: int
    gen_tokens: int
    accumulate: int  # batches per optimizer step of each adapter


def build_model(shape: str, device: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def workload(case: Case, vocab: int, seed: int):
    """(training samples, inference samples) per adapter slot, random tokens."""
    from vllm_loraserve.train.data import IGNORE, InferenceSample, Sample

    g = torch.Generator().manual_seed(seed)
    n_train = max(1, round(case.batch * case.train_frac))
    names = [f"a{i:02d}" for i in range(case.adapters)]

    def ids(n):
        return tuple(torch.randint(2, vocab, (n,), generator=g).tolist())

    train = [Sample(ids(case.prompt_len + case.completion_len),
                    (IGNORE,) * case.prompt_len + ids(case.completion_len),
                    {names[i % len(names)]: 1.0}) for i in range(n_train)]
    infer = [InferenceSample(ids(case.prompt_len), {names[i % len(names)]: 1.0},
                             case.gen_tokens) for i in range(case.batch - n_train)]
    return names, train, infer


def samples_per_step(case, names, train) -> dict[str, int]:
    per_batch = {n: sum(n in s.mix for s in train) for n in names}
    return {n: max(1, c) * case.accumulate for n, c in per_batch.items()}


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_loraserve(case, model, names, train, infer, steps, warmup, kernel, device, reuse_kv,
                  profile=None):
    from vllm_loraserve.train.config import AdapterTrainConfig, OptimizerConfig
    from vllm_loraserve.train.trainer import MultiAdapterTrainer

    sps = samples_per_step(case, names, train)
    configs = [AdapterTrainConfig(name=n, rank=RANKS[i % len(RANKS)],
                                  alpha=2 * RANKS[i % len(RANKS)], data="-",
                                  target_modules=TARGETS, samples_per_step=sps[n],
                                  optimizer=OptimizerConfig(kind="adamw", lr=1e-4))
               for i, n in enumerate(names)]
    trainer = MultiAdapterTrainer(model, configs, pad_id=0, eos_id=None, kernel=kernel)
    tokens, phases = 0, {}
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        r = trainer.step(train, infer, reuse_kv=reuse_kv)
        if step >= warmup:
            tokens += r.train_tokens + r.generated_tokens
            for k, v in r.seconds.items():
                phases[k] = phases.get(k, 0.0) + v
    _sync(device)
    seconds = time.perf_counter() - start
    if profile:  # one more step, untimed, under torch.profiler: where a step's time goes
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
        with torch_profile(activities=acts) as prof:
            trainer.step(train, infer, reuse_kv=reuse_kv)
            _sync(device)
        by = "self_cuda_time_total" if device != "cpu" else "self_cpu_time_total"
        with open(profile, "w") as f:
            f.write(prof.key_averages().table(sort_by=by, row_limit=30))
    return tokens, seconds, phases


def run_peft_solo(case, model, names, train, infer, steps, warmup, device):
    from peft import LoraConfig, get_peft_model

    for i, n in enumerate(names):
        r = RANKS[i % len(RANKS)]
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(TARGETS), lora_dropout=0.0)
        if i == 0:
            model = get_peft_model(model, cfg, adapter_name=n)
        else:
            model.add_adapter(n, cfg)
    opts, counts = {}, dict.fromkeys(names, 0)
    sps = samples_per_step(case, names, train)
    for n in names:
        model.set_adapter(n)
        opts[n] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    dev = torch.device(device)
    tokens = 0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        model.train()
        for n in names:
            mine = [s for s in train if n in s.mix]
            if not mine:
                continue
            model.set_adapter(n)
            ids = torch.tensor([s.input_ids for s in mine], device=dev)
            labels = torch.tensor([s.labels for s in mine], device=dev)
            logits = model(input_ids=ids).logits[:, :-1].float()
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="none").view(len(mine), -1)
            ((ce.sum(1) / (labels[:, 1:] != -100).sum(1)).sum() / sps[n]
             ).backward()
            counts[n] += len(mine)
            if counts[n] >= sps[n]:
                opts[n].step()
                opts[n].zero_grad()
                counts[n] = 0
            if step >= warmup:
                tokens += ids.numel()
        if infer:
            model.eval()
            with torch.no_grad():
                ids = torch.tensor([s.input_ids for s in infer], device=dev)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=case.gen_tokens, min_new_tokens=case.gen_tokens,
                                     do_sample=False, pad_token_id=0,
                                     adapter_names=[next(iter(s.mix)) for s in infer])
            if step >= warmup:
                tokens += (out.shape[1] - ids.shape[1]) * len(infer)
    _sync(device)
    return tokens, time.perf_counter() - start, {}


def probe_peft_padded(model, names, device) -> str:
    """Can PEFT train several adapters (padded to one rank) in one batch?"""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=max(RANKS), lora_alpha=2 * max(RANKS), target_modules=list(TARGETS))
    model = get_peft_model(model, cfg, adapter_name=names[0])
    model.add_adapter(names[1], cfg)
    model.train()
    ids = torch.zeros(2, 4, dtype=torch.long, device=device)
    try:
        model(input_ids=ids, adapter_names=names[:2]).logits.sum().backward()
    except Exception as e:  # PEFT raises ValueError; report whatever it says
        return f"not supported by PEFT: {type(e).__name__}: {e}"
    return "PEFT accepted a mixed-adapter training batch (implement this mode)"


def measure(case, mode, args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    model = build_model(case.shape, device, dtype, args.seed)
    names, train, infer = workload(case, SHAPES[case.shape][5], args.seed)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"mode": mode, **asdict(case)}
    try:
        if mode.startswith("loraserve"):
            profile = args.profile and mode == "loraserve" and os.path.join(
                args.profile, f"{case.shape}-{case.adapters}-{case.train_frac}.txt")
            tokens, secs, phases = run_loraserve(case, model, names, train, infer, args.steps,
                                                 args.warmup, args.kernel, device,
                                                 reuse_kv=mode == "loraserve", profile=profile)
        elif mode == "peft-solo":
            tokens, secs, phases = run_peft_solo(case, model, names, train, infer, args.steps,
                                                 args.warmup, device)
        else:
            row["result"] = probe_peft_padded(model, names, device)
            return row
        row.update(tokens=tokens, seconds=secs, tokens_per_s=tokens / secs,
                   phase_seconds=phases)
    except torch.OutOfMemoryError as e:
        row["result"] = f"out of memory: {str(e)[:200]}"
    finally:
        if device.startswith("cuda"):
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["1b"], choices=sorted(SHAPES))
    p.add_argument("--adapters", nargs="+", type=int, default=[8, 32])
    p.add_argument("--train-frac", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    modes = ["loraserve", "loraserve-reprefill", "peft-solo", "peft-padded"]
    p.add_argument("--modes", nargs="+", default=modes, choices=modes)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=20, help="ALoRA generates 20")
    p.add_argument("--accumulate", type=int, default=1,
                   help="batches per optimizer step of each adapter")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case and mode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--kernel", default=None, help="triton (GPU default) or torch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke: tiny shape, batch 8, short sequences, 1 step")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", default=None,
                   help="folder: profile one extra step of each loraserve case into it")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.adapters, args.batch = ["tiny"], [3], 8
        args.prompt_len, args.completion_len, args.gen_tokens = 6, 4, 3
        args.steps = 1
    gpu = args.device.startswith("cuda")
    args.kernel = args.kernel or ("triton" if gpu else "torch")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    print(json.dumps({k: v for k, v in vars(args).items() if k != "out"}))
    rows = []
    for shape in args.shape:
        for n in args.adapters:
            for frac in args.train_frac:
                case = Case(shape, n, frac, args.batch, args.prompt_len, args.completion_len,
                            args.gen_tokens, args.accumulate)
                for mode in args.modes:
                    if mode == "peft-padded" and rows and any(
                            r["mode"] == mode and r["shape"] == shape for r in rows):
                        continue  # one probe per shape says it
                    row = measure(case, mode, args)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
