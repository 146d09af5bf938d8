"""LoRA compute over paged adapter weights, behind one small interface.

A backend computes, for one vLLM LoRA layer (`ModuleSlices`) and one step:

    shrink: h[s, t, :rank] = x[t] @ A_{slot(t), s}.T          (rest of h undefined)
    expand: y[t, cols(s)] += h[s, t, :rank] @ Bt_{slot(t), s}

for every token t with an adapter; tokens without one are never touched.
Training (vllm_loraserve.train) adds the backward of both, each slot at its
own rank:

    expand_grad_h: dh[s, t, :rank] = dy[t, cols(s)] @ Bt_{slot(t), s}.T
    shrink_grad_x: dx[t] += sum_s dh[s, t, :rank] @ A_{slot(t), s}
    grad_pool:     dA_{slot, s} += dh[s, toks].T @ x[toks]
                   dBt_{slot, s} += h[s, toks].T @ dy[toks, cols(s)]

where the weight gradients land in a tensor laid out as the pool (pages).
A page load goes through the backend too: `page_writer(pages)` (once, for
the pool's per-layer page views) returns a function `write(page_ids,
streams)` that copies row l of `streams` ([layers, n * page_size]) into
pages `page_ids` (n ids, on the device) of layer l, for every layer.
Backends are chosen by name: `torch` (reference, CPU path) and `triton`
(MBGMM/MBGMV on the GPU; on CPU only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable, TokenBatch
from vllm_loraserve.kernels.tile_table import TileTable
from vllm_loraserve.paging.layout import LayerLayout

PageWriter = Callable[[torch.Tensor, torch.Tensor], None]


class KernelBackend(Protocol):
    """What the pool (worker/pool.py) calls on a backend, per LoRA layer and
    step. `pool` is one layer's pages ([num_pages, page_size]); A_{slot, s}
    ([rank, in]) and Bt_{slot, s} ([rank, out], scaling folded in) are read
    from it through `slots` and `layout`. Tokens without an adapter are in no
    block of `batch` and are never touched."""

    name: str

    def shrink(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout,
               h_zeroed: bool = False, zero_next: torch.Tensor | None = None) -> None:
        """h[s, t, :rank] = x[t] @ A_{slot(t), s}.T for each slice s of `module`;
        other entries of h ([slices, tokens, max_rank], fp32) are undefined
        after it (no backend may read them: zeroing h costs a launch).
        `h_zeroed`: the caller guarantees h is all zero (a backend that needs
        it zero may skip its own zeroing). `zero_next` (contiguous fp32, not
        overlapping h): all zero after the call, so that the next shrink's h
        can be it, `h_zeroed` (a backend zeroes it in the same launch where
        it can: one memset launch less a module)."""

    def expand(self, h: torch.Tensor, pool: torch.Tensor, y: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout) -> None:
        """y[t, cols(s)] += h[s, t, :rank] @ Bt_{slot(t), s}, reading h only
        up to each token's rank."""

    def page_writer(self, pages: list[torch.Tensor]) -> PageWriter:
        """`write(page_ids, streams)`: row l of `streams` ([layers, n *
        page_size]) into pages `page_ids` (n ids, on the device) of layer l,
        for every layer. `pages` must stay allocated."""

    def warm_up(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
                batches: list[TokenBatch], slots: SlotTable, module: ModuleSlices,
                layout: LayerLayout) -> int:
        """Compile whatever `shrink` and `expand` of `module` would compile
        for `batches` (shapes only: their blocks are empty), before serving.
        Returns the number of variants compiled or found compiled."""

BACKENDS = {
    "torch": "vllm_loraserve.kernels.reference:TorchBackend",
    "triton": "vllm_loraserve.kernels.triton_mbgmm:TritonBackend",
}


def get_backend(name: str, tiles: TileTable | None = None) -> KernelBackend:
    """A backend instance by name (imported lazily: triton is optional);
    `tiles`: a tuned tile table (kernels/tile_table.py), for `triton` only."""
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA kernel backend {name!r}; choose from {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    if tiles is None:
        return backend()
    if name != "triton":
        raise ValueError(f"a tile table tunes the triton kernels; this pool runs {name!r}")
    return backend(table=tiles)


def make_batch(token_slots: Sequence[int] | np.ndarray, device: torch.device | str = "cpu",
               block_m: int | None = None, ranks=None) -> TokenBatch:
    """The step's TokenBatch, with a block height suited to its shape:
    one tensor-core tile when adapters have few tokens each (decode),
    taller when they have many (prefill). `ranks[slot]`, where given: the
    slots' ranks, for the shrink's jobs (TokenBatch.build)."""
    if block_m is None:
        slots = np.asarray(token_slots)
        used = slots[slots >= 0]
        per_adapter = used.size / max(1, np.unique(used).size)
        block_m = 16 if per_adapter <= 16 else 64
    return TokenBatch.build(token_slots, block_m, device, ranks)


__all__ = ["BACKENDS", "KernelBackend", "ModuleSlices", "PageWriter", "SlotTable", "TokenBatch",
           "get_backend", "make_batch"]
