"""Many adapters of different ranks inside a frozen HF model: each target
nn.Linear becomes a `MultiLoRALinear` that adds the LoRA deltas of the
adapters its tokens belong to, computed by the paged kernels (forward and
backward), each adapter at its own rank.

Each adapter keeps plain leaf parameters A [r, in] and B [out, r] (what its
optimizer steps and what PEFT saves). Every grad-enabled forward packs them,
differentiably (scaling folded into Bt, paging/layout.pack_layer), into the
layer's page pool; `LoRAFunction` runs the kernels over the pool and returns
the pool's gradient, which autograd carries back to the leaves. Without
grad (generation), the packed pool is reused until an optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vllm_loraserve.adapters.peft import short_name
from vllm_loraserve.kernels import TokenBatch, make_batch
from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer

ALIGN = 256  # the Triton tiles divide it (paging/layout.py)
PAGE_SIZE = 16 * ALIGN
GRAD_BLOCK_M = 4096  # the weight-gradient kernel reduces a slot's tokens in one block


@dataclass(frozen=True)
class Routing:
    """Which adapters each token of one forward uses (shared by all layers).

    Row i of the kernels' input is token `rows[i]` of the flattened batch
    (None: row i is token i), for adapter slot `slots[i]` with weight
    `weights[i]` (None: all 1). A token mixing k adapters has k rows."""

    num_tokens: int
    rows: torch.Tensor | None
    weights: torch.Tensor | None
    forward: TokenBatch
    backward: TokenBatch  # training rows only: inference rows get no gradient
    grad: TokenBatch  # as `backward`, in long blocks for the weight gradients

    @classmethod
    def build(cls, token_mixes: Sequence[Mapping[int, float] | None],
              trains: Sequence[bool], device: torch.device) -> Routing:
        """`token_mixes[t]`: slot -> weight for token t (None: no adapter);
        `trains[t]`: whether token t's sample is a training sample."""
        rows, slots, weights, train_slots = [], [], [], []
        for t, (mix, train) in enumerate(zip(token_mixes, trains, strict=True)):
            for slot, w in (mix or {-1: 1.0}).items():
                rows.append(t)
                slots.append(slot)
                weights.append(w)
                train_slots.append(slot if train else -1)
        identity = rows == list(range(len(token_mixes)))
        ones = all(w == 1.0 for w in weights)
        return cls(
            len(token_mixes),
            None if identity else torch.tensor(rows, device=device),
            None if ones else torch.tensor(weights, device=device),
            make_batch(slots, device),
            make_batch(train_slots, device),
            TokenBatch.build(train_slots, GRAD_BLOCK_M, device),
        )


class LoRAState:
    """What every wrapped layer of one model shares: the kernel backend, the
    current routing and a counter bumped whenever adapter weights change."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.routing: Routing | None = None
        self.version = 0


@dataclass(frozen=True)
class _Op:
    state: LoRAState
    routing: Routing
    slots: SlotTable
    module: ModuleSlices
    layout: LayerLayout


class LoRAFunction(torch.autograd.Function):
    """delta = LoRA(x) over a page pool: forward shrink+expand; backward
    expand_grad_h, shrink_grad_x and grad_pool (kernels/__init__.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pool: torch.Tensor, op: _Op) -> torch.Tensor:
        be, r = op.state.backend, op.routing
        h = torch.zeros(1, x.shape[0], op.slots.max_rank, dtype=torch.float32, device=x.device)
        be.shrink(x, pool, h, r.forward, op.slots, op.module, op.layout)
        y = torch.zeros(x.shape[0], op.module.out_features[0], dtype=x.dtype, device=x.device)
        be.expand(h, pool, y, r.forward, op.slots, op.module, op.layout)
        ctx.save_for_backward(x, pool, h)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, pool, h = ctx.saved_tensors
        op = ctx.op
        be, r = op.state.backend, op.routing
        dy = dy.contiguous()
        dh = torch.zeros_like(h)
        be.expand_grad_h(dy, pool, dh, r.backward, op.slots, op.module, op.layout)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x)
            be.shrink_grad_x(dh, pool, dx, r.backward, op.slots, op.module, op.layout)
        dpool = torch.zeros_like(pool)
        be.grad_pool(x, h, dy, dh, dpool, r.grad, op.slots, op.module, op.layout)
        return dx, dpool, None


@dataclass
class AdapterParams:
    """One adapter's trainable weights: module path -> (A, B) leaves."""

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[nn.Parameter, nn.Parameter]]

    def parameters(self) -> list[nn.Parameter]:
        return [p for ab in self.weights.values() for p in ab]


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear plus the deltas of the adapters (slots) that
    target it. Slot i is adapter i of the model's list; adapters that do not
    target this module hold an empty slot."""

    def __init__(self, base: nn.Linear, path: str, adapters: Sequence[AdapterParams],
                 state: LoRAState, max_rank: int) -> None:
        super().__init__()
        self.base, self.path, self.state = base, path, state
        spec = SliceSpec(short_name(path), base.in_features, base.out_features)
        self.layout = LayerLayout((spec,), PAGE_SIZE, ALIGN)
        self.module = ModuleSlices.of(self.layout, [spec.name])
        self._adapters = [a if path in a.weights else None for a in adapters]
        entries, cursor = [], 0
        self._placements = []
        for a in self._adapters:
            if a is None:
                entries.append(None)
                continue
            placement = self.layout.place(a.rank, [spec.name])
            entries.append((placement, list(range(cursor, cursor + placement.num_pages))))
            self._placements.append((a, placement))
            cursor += placement.num_pages
        self.slots = SlotTable.build(self.layout, entries, max_rank, base.weight.device)
        self._cached: tuple[int, torch.Tensor] | None = None

    def pool(self) -> torch.Tensor:
        """[pages, page_size] in the base weight's dtype, differentiable in the
        adapters' leaves when grad is enabled."""
        if not torch.is_grad_enabled() and self._cached and self._cached[0] == self.state.version:
            return self._cached[1]
        streams = [pack_layer(self.layout, placement, {self.module_name: a.weights[self.path]},
                              a.scaling, self.base.weight.dtype)
                   for a, placement in self._placements]
        pool = torch.cat(streams).view(-1, self.layout.page_size)
        if not torch.is_grad_enabled():
            self._cached = (self.state.version, pool)
        return pool

    @property
    def module_name(self) -> str:
        return self.layout.slices[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        r = self.state.routing
        if r is None or not self._placements:
            return y
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != r.num_tokens:
            raise RuntimeError(f"{self.path}: {flat.shape[0]} tokens, routing has {r.num_tokens}")
        if r.rows is not None:
            flat = flat[r.rows]
        delta = LoRAFunction.apply(flat.contiguous(), self.pool(),
                                   _Op(self.state, r, self.slots, self.module, self.layout))
        if r.rows is not None:
            w = delta if r.weights is None else delta * r.weights[:, None].to(delta.dtype)
            delta = torch.zeros(r.num_tokens, delta.shape[1], dtype=delta.dtype,
                                device=delta.device).index_add(0, r.rows, w)
        return y + delta.view(y.shape)


def init_params(name: str, rank: int, scaling: float, dims: Mapping[str, tuple[int, int]],
                device: torch.device, generator: torch.Generator,
                init: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None) -> AdapterParams:
    """fp32 leaves: copied from `init` (a loaded PEFT adapter), else PEFT's
    default init (A Kaiming-uniform with a = sqrt(5), B = 0)."""
    weights = {}
    for path, (n_in, n_out) in sorted(dims.items()):
        if init is not None:
            a, b = (t.float() for t in init[path])
        else:
            a = torch.empty(rank, n_in)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(n_out, rank)
        weights[path] = (nn.Parameter(a.to(device)), nn.Parameter(b.to(device)))
    return AdapterParams(name, rank, scaling, weights)


def target_dims(model: nn.Module, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of the model's nn.Linear layers named in `targets`."""
    return {path: (m.in_features, m.out_features) for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and short_name(path) in targets}


def attach(model: nn.Module, adapters: Sequence[AdapterParams], state: LoRAState) -> None:
    """Freeze the model and wrap every nn.Linear some adapter targets."""
    for p in model.parameters():
        p.requires_grad_(False)
    paths = {path for a in adapters for path in a.weights}
    max_rank = max(a.rank for a in adapters)
    for path in sorted(paths):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), path, adapters, state,
                                               max_rank))
