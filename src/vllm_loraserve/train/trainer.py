"""The mixed-batch step (ALoRA §4.1): one forward over training and
inference samples of many adapters, one backward, each adapter's optimizer
stepping when its own `samples_per_step` samples are in, then generation for
the inference samples from their prefill KV.

Loss normalisation (what makes an adapter end where training it alone
would): each training sample's loss is the mean cross-entropy over its
completion tokens; the batch loss is the plain sum over samples, so the
gradient an adapter accumulates is the sum of its samples' gradients (times
the sample's weight for that adapter, through the mixed forward). When
adapter a has accumulated `samples_per_step` samples, its gradient is divided
by that count and its optimizer steps: the gradient of the mean loss over
that micro-batch, as a PEFT run on a's samples alone computes it (`flush`
steps on fewer, divided by their number, when a run ends). A batch
never holds a sample past an adapter's step boundary (`compose`), so every
sample's gradient is taken at the weights a solo run would have then.

KV reuse and its staleness: the inference samples' prompt KV and their
first token come from the prefill, which ran with the weights from before
this step's optimizer updates; the tokens after the first use the new
weights but attend to that stale prompt KV. `reuse_kv=False` prefills the
prompts again after the update instead (fresh, and slower).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_loraserve.adapters.peft import load_adapter
from vllm_loraserve.kernels import get_backend
from vllm_loraserve.train.config import AdapterTrainConfig, OptimizerConfig
from vllm_loraserve.train.data import IGNORE, InferenceSample, Sample
from vllm_loraserve.train.lora import AdapterParams, LoRAState, attach, init_params, target_dims
from vllm_loraserve.train.mixed import MixedBatch, decode_routing


@dataclass
class StepResult:
    losses: dict[str, float]
    """Per adapter: mean loss of its samples in this batch (mixed samples
    count for each adapter they name)."""
    updated: list[str]
    """Adapters whose optimizer stepped."""
    generated: list[list[int]]
    """Per inference sample: its new tokens (up to EOS or max_new_tokens)."""
    train_tokens: int
    generated_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)


def make_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    if cfg.kind == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def _scaling(cfg: AdapterTrainConfig) -> float:
    return cfg.alpha / (math.sqrt(cfg.rank) if cfg.use_rslora else cfg.rank)


class MultiAdapterTrainer:
    """Trains `adapters` on `model` (an HF causal LM whose base weights stay
    frozen) in mixed batches; adapter i is kernel slot i."""

    def __init__(self, model, adapters: Sequence[AdapterTrainConfig], *, pad_id: int,
                 eos_id: int | None = None, kernel: str = "torch", seed: int = 0) -> None:
        self.model, self.pad_id, self.eos_id = model, pad_id, eos_id
        self.configs = {a.name: a for a in adapters}
        self.device = next(model.parameters()).device
        g = torch.Generator().manual_seed(seed)
        self.params: dict[str, AdapterParams] = {}
        for a in adapters:
            dims = target_dims(model, a.target_modules)
            if not dims:
                raise ValueError(f"adapter {a.name}: the model has no module named in "
                                 f"{list(a.target_modules)}")
            init = None
            if a.init_from is not None:
                spec, init = load_adapter(a.init_from)
                if spec.rank != a.rank or set(init) != set(dims) or \
                        not math.isclose(spec.scaling, _scaling(a)):
                    raise ValueError(
                        f"adapter {a.name}: init_from {a.init_from} (rank {spec.rank}, scaling "
                        f"{spec.scaling:g}, {len(init)} modules) does not match the config "
                        f"(rank {a.rank}, scaling {_scaling(a):g}, {len(dims)} modules of "
                        f"{list(a.target_modules)})")
            self.params[a.name] = init_params(a.name, a.rank, _scaling(a), dims, self.device,
                                              g, init)
        self.slot_of = {name: i for i, name in enumerate(self.params)}
        self.state = LoRAState(get_backend(kernel), self.device)
        self.groups = attach(model, list(self.params.values()), self.state)
        self.optimizers = {n: make_optimizer(self.configs[n].optimizer, p.parameters())
                           for n, p in self.params.items()}
        self.accumulated = dict.fromkeys(self.params, 0)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(seed)

    def remaining(self, name: str) -> int:
        """Samples `name` can still take before its optimizer steps."""
        return self.configs[name].samples_per_step - self.accumulated[name]

    def compose(self, streams: Mapping[str, Iterator[Sample]], batch_size: int) -> list[Sample]:
        """Up to `batch_size` samples, round-robin over the adapters in slot
        order, none past an adapter's step boundary."""
        room = {n: self.remaining(n) for n in streams}
        out: list[Sample] = []
        while len(out) < batch_size and any(room.values()):
            for name in streams:
                if room[name] > 0 and len(out) < batch_size:
                    out.append(next(streams[name]))
                    room[name] -= 1
        return out

    def step(self, train: Sequence[Sample], infer: Sequence[InferenceSample] = (),
             reuse_kv: bool = True) -> StepResult:
        per_adapter = Counter(n for s in train for n, w in s.mix.items() if w > 0)
        for n, count in per_adapter.items():
            if count > self.remaining(n):
                raise ValueError(f"{count} samples of adapter {n} in one batch, but its "
                                 f"optimizer steps after {self.remaining(n)} more")
        times, t0 = {}, time.perf_counter()
        batch = MixedBatch.build(train, infer, self.slot_of, self.pad_id, self.device)
        self.state.routing = batch.routing
        with torch.set_grad_enabled(bool(train)):
            out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             use_cache=bool(infer) and reuse_kv)
        losses: dict[str, list[float]] = {}
        if train:
            nt = batch.num_train
            logits = out.logits[:nt, :-1].float()
            labels = batch.labels[:nt, 1:]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 reduction="none", ignore_index=IGNORE).view(labels.shape)
            per_sample = ce.sum(1) / (labels != IGNORE).sum(1)
            times["forward"] = time.perf_counter() - t0
            per_sample.sum().backward()
            for group in self.groups:
                group.collect_grads()
            times["backward"] = time.perf_counter() - t0 - times["forward"]
            for s, loss in zip(train, per_sample.tolist(), strict=True):
                for n, w in s.mix.items():
                    if w > 0:
                        self.accumulated[n] += 1
                        losses.setdefault(n, []).append(loss)
        updated = self._apply_updates()
        generated = []
        if infer:
            t1 = time.perf_counter()
            generated = self._generate(batch, out, infer, reuse_kv)
            times["generate"] = time.perf_counter() - t1
        self.state.routing = None
        times["total"] = time.perf_counter() - t0
        return StepResult({n: sum(v) / len(v) for n, v in losses.items()}, updated, generated,
                          sum(batch.lengths[:batch.num_train]),
                          sum(len(g) for g in generated), times)

    def flush(self) -> dict[str, int]:
        """Step every adapter that holds fewer than its `samples_per_step`
        samples (a run ends between two of its steps), on the mean gradient of
        the samples it holds: as a solo run applies its last, short
        micro-batch. Returns name -> that number of samples."""
        pending = {n: k for n, k in self.accumulated.items() if k > 0}
        self._apply_updates(partial=True)
        return pending

    def _apply_updates(self, partial: bool = False) -> list[str]:
        updated = []
        for name, params in self.params.items():
            n = self.accumulated[name]
            if n == 0 or (n < self.configs[name].samples_per_step and not partial):
                continue
            with torch.no_grad():
                for p in params.parameters():
                    p.grad /= n
            self.optimizers[name].step()
            self.optimizers[name].zero_grad()
            self.accumulated[name] = 0
            updated.append(name)
        if updated:
            self.state.version += 1
        return updated

    @torch.no_grad()
    def _generate(self, batch: MixedBatch, out, infer: Sequence[InferenceSample],
                  reuse_kv: bool) -> list[list[int]]:
        nt = batch.num_train
        if reuse_kv:
            cache = out.past_key_values
            cache.batch_select_indices(torch.arange(nt, nt + len(infer), device=self.device))
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
            logits, mask = out.logits[nt:].detach(), batch.attention_mask[nt:]
            lengths = batch.lengths[nt:]
        else:
            fresh = MixedBatch.build([], infer, self.slot_of, self.pad_id, self.device)
            self.state.routing = fresh.routing
            o = self.model(input_ids=fresh.input_ids, attention_mask=fresh.attention_mask,
                           use_cache=True)
            cache, logits, mask, lengths = o.past_key_values, o.logits, fresh.attention_mask, \
                fresh.lengths
        rows = torch.arange(len(infer), device=self.device)
        pos = torch.tensor(lengths, device=self.device)
        tokens = self._pick(logits[rows, pos - 1], infer)
        steps = [tokens]
        self.state.routing = decode_routing(infer, self.slot_of, self.device)
        for k in range(1, max(s.max_new_tokens for s in infer)):
            mask = torch.cat([mask, mask.new_ones(len(infer), 1)], dim=1)
            o = self.model(input_ids=tokens[:, None], attention_mask=mask,
                           position_ids=(pos + k - 1)[:, None], past_key_values=cache,
                           use_cache=True)
            cache = o.past_key_values
            tokens = self._pick(o.logits[:, -1], infer)
            steps.append(tokens)
        table = torch.stack(steps, 1).tolist()
        result = []
        for s, row in zip(infer, table, strict=True):
            row = row[:s.max_new_tokens]
            if self.eos_id is not None and self.eos_id in row:
                row = row[:row.index(self.eos_id) + 1]
            result.append(row)
        return result

    def _pick(self, logits: torch.Tensor, infer: Sequence[InferenceSample]) -> torch.Tensor:
        greedy = logits.argmax(-1)
        if all(s.temperature <= 0 for s in infer):  # decided on the host: no device sync
            return greedy
        temps = torch.tensor([s.temperature for s in infer], device=logits.device)
        probs = torch.softmax(logits.float() / temps.clamp(min=1e-6)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=self.sample_gen)[:, 0]
        return torch.where(temps > 0, sampled, greedy)

    def adapter_weights(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (A, B), detached CPU fp32 copies (the PEFT layout)."""
        return {path: (a.detach().cpu().clone(), b.detach().cpu().clone())
                for path, (a, b) in self.params[name].weights.items()}
