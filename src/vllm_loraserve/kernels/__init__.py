"""LoRA compute over paged adapter weights, behind one small interface.

A backend computes, for one vLLM LoRA layer (`ModuleSlices`) and one step:

    shrink: h[s, t, :rank] = x[t] @ A_{slot(t), s}.T          (h zeroed first)
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
from collections.abc import Sequence

import numpy as np
import torch

from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable, TokenBatch

BACKENDS = {
    "torch": "vllm_loraserve.kernels.reference:TorchBackend",
    "triton": "vllm_loraserve.kernels.triton_mbgmm:TritonBackend",
}


def get_backend(name: str):
    """A backend instance by name (imported lazily: triton is optional)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA kernel backend {name!r}; choose from {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def make_batch(token_slots: Sequence[int] | np.ndarray, device: torch.device | str = "cpu",
               block_m: int | None = None) -> TokenBatch:
    """The step's TokenBatch, with a block height suited to its shape:
    one tensor-core tile when adapters have few tokens each (decode),
    taller when they have many (prefill)."""
    if block_m is None:
        slots = np.asarray(token_slots)
        used = slots[slots >= 0]
        per_adapter = used.size / max(1, np.unique(used).size)
        block_m = 16 if per_adapter <= 16 else 64
    return TokenBatch.build(token_slots, block_m, device)


__all__ = ["BACKENDS", "ModuleSlices", "SlotTable", "TokenBatch", "get_backend", "make_batch"]
