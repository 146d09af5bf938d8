"""Many adapters of different ranks inside a frozen HF model: each target
nn.Linear becomes a `MultiLoRALinear` that adds the LoRA deltas of the
adapters its tokens belong to, computed by the paged kernels (forward and
backward), each adapter at its own rank.

Each adapter keeps fp32 leaf parameters A and B in PEFT's layout (what its
optimizer steps and what PEFT saves), stacked over the layers of one kind.
The layers of a kind share one page pool (`LayerGroup`), written from the
leaves whenever an optimizer has stepped (scaling folded into Bt,
paging/layout.py); `LoRAFunction` runs the kernels over it, and its
backward adds the weight gradient into a pool-shaped buffer that
`LayerGroup.collect_grads` moves to the leaves after the backward pass.
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
from vllm_loraserve.paging.layout import (
    AdapterPlacement,
    LayerLayout,
    SliceSpec,
    segment_rows,
    write_segment,
)

ALIGN = 256  # the Triton tiles divide it (paging/layout.py)
PAGE_SIZE = 16 * ALIGN
GRAD_BLOCK_M = 4096  # the weight-gradient kernel reduces a slot's tokens in one block
GroupKey = tuple[str, int, int]  # (short module name, in, out)


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

    def __init__(self, backend, device: torch.device) -> None:
        self.backend = backend
        self.routing: Routing | None = None
        self.version = 0
        self.anchor = torch.zeros(0, device=device, requires_grad=True)  # see LoRAFunction


@dataclass(frozen=True)
class _Op:
    state: LoRAState
    routing: Routing
    group: LayerGroup
    layer: int


def _forward(x: torch.Tensor, pool: torch.Tensor, op: _Op) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta [tokens, out], h): shrink then expand over `pool`."""
    be, r, g = op.state.backend, op.routing, op.group
    h = torch.empty(1, x.shape[0], g.slots.max_rank, dtype=torch.float32, device=x.device)
    be.shrink(x, pool, h, r.forward, g.slots, g.module, g.layout)
    y = torch.zeros(x.shape[0], g.module.out_features[0], dtype=x.dtype, device=x.device)
    be.expand(h, pool, y, r.forward, g.slots, g.module, g.layout)
    return y, h


class LoRAFunction(torch.autograd.Function):
    """delta = LoRA(x) over one layer of a group's pool. Backward:
    expand_grad_h and shrink_grad_x give dx; grad_pool adds the weight
    gradient into the group's gradient buffer (kernels/__init__.py), which is
    why the pool is not an autograd input. `anchor` (LoRAState.anchor) is:
    it requires grad, so the backward runs even where x does not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, op: _Op) -> torch.Tensor:
        y, h = _forward(x, op.group.layer_pool(op.layer), op)
        ctx.save_for_backward(x, h)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, h = ctx.saved_tensors
        op = ctx.op
        be, r, g = op.state.backend, op.routing, op.group
        pool = g.layer_pool(op.layer)
        dy = dy.contiguous()
        dh = torch.zeros_like(h)
        be.expand_grad_h(dy, pool, dh, r.backward, g.slots, g.module, g.layout)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x)
            be.shrink_grad_x(dh, pool, dx, r.backward, g.slots, g.module, g.layout)
        be.grad_pool(x, h, dy, dh, g.layer_grad(op.layer), r.grad, g.slots, g.module, g.layout)
        return dx, None, None


@dataclass
class AdapterParams:
    """One adapter's trainable weights, stacked per layer group (the layers
    of one kind, `LayerGroup`): group key -> (A [L, r, in], B [L, out, r])
    fp32 leaves, layer l of the group being module path `paths[key][l]`.
    Stacking changes nothing for the optimizers (they are elementwise) and
    lets a group pack or unpack an adapter for all its layers in one op."""

    name: str
    rank: int
    scaling: float
    stacks: dict[GroupKey, tuple[nn.Parameter, nn.Parameter]]
    paths: dict[GroupKey, list[str]]

    def parameters(self) -> list[nn.Parameter]:
        return [p for ab in self.stacks.values() for p in ab]

    @property
    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (A [r, in], B [out, r]): views of the stacks (the PEFT layout)."""
        return {path: (a[i], b[i]) for key, (a, b) in self.stacks.items()
                for i, path in enumerate(self.paths[key])}

    def grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (dA, dB) accumulated since the optimizer last stepped."""
        return {path: (a.grad[i], b.grad[i]) for key, (a, b) in self.stacks.items()
                for i, path in enumerate(self.paths[key])}


class LayerGroup:
    """The wrapped layers of one kind (same short name and shape): one page
    layout, one slot table (adapter i of the model in slot i) and one pool
    for all of them, [L, pages * page_size] in the base dtype, layer l's
    pages being row l. The pool is written (without autograd) only when
    adapter weights change; in training, the kernels add each layer's
    weight gradient into row l of `grad` (fp32, laid out as the pool), and
    `collect_grads` moves it to the adapters' leaves: a few ops per adapter
    and group, not per adapter and layer."""

    def __init__(self, key: GroupKey, paths: Sequence[str], adapters: Sequence[AdapterParams],
                 state: LoRAState, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        name, n_in, n_out = key
        self.key, self.paths, self.state = key, list(paths), state
        self.layout = LayerLayout((SliceSpec(name, n_in, n_out),), PAGE_SIZE, ALIGN)
        self.module = ModuleSlices.of(self.layout, [name])
        entries, cursor = [], 0
        self.members: list[tuple[AdapterParams, AdapterPlacement, int]] = []
        for a in adapters:
            if key not in a.stacks:
                entries.append(None)
                continue
            placement = self.layout.place(a.rank, [name])
            entries.append((placement, list(range(cursor, cursor + placement.num_pages))))
            self.members.append((a, placement, cursor * PAGE_SIZE))
            cursor += placement.num_pages
        self.slots = SlotTable.build(self.layout, entries, max_rank, device)
        self.pool = torch.zeros(len(self.paths), cursor * PAGE_SIZE, dtype=dtype, device=device)
        self.grad: torch.Tensor | None = None
        self._version = -1

    def _segments(self, a: AdapterParams, placement: AdapterPlacement, base: int,
                  buf: torch.Tensor) -> list[torch.Tensor]:
        """(A rows [L, r, in], Bt rows [L, r, out]) of `a` read from `buf` (copies)."""
        return [segment_rows(self.layout, buf, base + placement.seg_offsets[seg], seg, a.rank)
                for seg in (0, 1)]

    def layer_pool(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s pages, [pages, page_size], holding the current weights."""
        if self._version != self.state.version:
            with torch.no_grad():
                for a, placement, base in self.members:
                    A, B = a.stacks[self.key]
                    for seg, rows, scaling in ((0, A, None), (1, B.transpose(1, 2), a.scaling)):
                        write_segment(self.layout, self.pool, base + placement.seg_offsets[seg],
                                      seg, rows, scaling)
            self._version = self.state.version
        return self.pool[layer].view(-1, PAGE_SIZE)

    def layer_grad(self, layer: int) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.zeros_like(self.pool, dtype=torch.float32)
        return self.grad[layer].view(-1, PAGE_SIZE)

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Add the pool gradient into the leaves' .grad (dB = scaling *
        dBt^T, as the packing multiplies), then clear it."""
        if self.grad is None:
            return
        for a, placement, base in self.members:
            da, dbt = self._segments(a, placement, base, self.grad)
            A, B = a.stacks[self.key]
            for p, g in ((A, da), (B, dbt.transpose(1, 2) * a.scaling)):
                if p.grad is None:
                    p.grad = g.to(p.dtype, copy=True).contiguous()
                else:
                    p.grad += g
        self.grad.zero_()


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear plus the deltas of the adapters that target it:
    layer `layer` of `group`."""

    def __init__(self, base: nn.Linear, group: LayerGroup, layer: int) -> None:
        super().__init__()
        self.base, self.group, self.layer = base, group, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        state = self.group.state
        r = state.routing
        if r is None or not self.group.members:
            return y
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != r.num_tokens:
            raise RuntimeError(f"{self.group.paths[self.layer]}: {flat.shape[0]} tokens, "
                               f"routing has {r.num_tokens}")
        if r.rows is not None:
            flat = flat[r.rows]
        op = _Op(state, r, self.group, self.layer)
        if torch.is_grad_enabled():
            delta = LoRAFunction.apply(flat.contiguous(), state.anchor, op)
        else:
            delta = _forward(flat.contiguous(), self.group.layer_pool(self.layer), op)[0]
        if r.rows is not None:
            w = delta if r.weights is None else delta * r.weights[:, None].to(delta.dtype)
            delta = torch.zeros(r.num_tokens, delta.shape[1], dtype=delta.dtype,
                                device=delta.device).index_add(0, r.rows, w)
        return y + delta.view(y.shape)


def group_paths(dims: Mapping[str, tuple[int, int]]) -> dict[GroupKey, list[str]]:
    """Module path -> (in, out), grouped by (short name, in, out); paths sorted."""
    groups: dict[GroupKey, list[str]] = {}
    for path, (n_in, n_out) in sorted(dims.items()):
        groups.setdefault((short_name(path), n_in, n_out), []).append(path)
    return groups


def init_params(name: str, rank: int, scaling: float, dims: Mapping[str, tuple[int, int]],
                device: torch.device, generator: torch.Generator,
                init: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None) -> AdapterParams:
    """fp32 leaves: copied from `init` (a loaded PEFT adapter), else PEFT's
    default init (A Kaiming-uniform with a = sqrt(5), B = 0), drawn per
    module in path order."""
    weights = {}
    for path, (n_in, n_out) in sorted(dims.items()):
        if init is not None:
            a, b = (t.float() for t in init[path])
        else:
            a = torch.empty(rank, n_in)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(n_out, rank)
        weights[path] = (a, b)
    paths = group_paths(dims)
    stacks = {key: tuple(nn.Parameter(torch.stack([weights[p][i] for p in ps]).to(device))
                         for i in (0, 1))
              for key, ps in paths.items()}
    return AdapterParams(name, rank, scaling, stacks, paths)


def target_dims(model: nn.Module, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of the model's nn.Linear layers named in `targets`."""
    return {path: (m.in_features, m.out_features) for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and short_name(path) in targets}


def attach(model: nn.Module, adapters: Sequence[AdapterParams],
           state: LoRAState) -> list[LayerGroup]:
    """Freeze the model and wrap every nn.Linear some adapter targets, one
    LayerGroup per kind of layer; returns the groups."""
    for p in model.parameters():
        p.requires_grad_(False)
    paths: dict[GroupKey, list[str]] = {}
    for a in adapters:
        for key, ps in a.paths.items():
            if paths.setdefault(key, ps) != ps:
                raise ValueError(f"adapter {a.name}: layers {ps[:2]}... of {key} differ from "
                                 f"another adapter's")
    max_rank = max(a.rank for a in adapters)
    groups = []
    for key, ps in sorted(paths.items()):
        base = model.get_submodule(ps[0]).weight
        group = LayerGroup(key, ps, adapters, state, max_rank, base.dtype, base.device)
        groups.append(group)
        for layer, path in enumerate(ps):
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(parent, child, MultiLoRALinear(getattr(parent, child), group, layer))
    return groups
