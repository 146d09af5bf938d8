"""Fix for vLLM's CPU LoRA ops: tokens without an adapter must stay untouched.

vLLM maps a token with no adapter to slot index -1. Its torch-native ops
(`vllm/lora/ops/torch_ops/lora_ops.py`, 0.26 and 0.27) index the stacked
weights with that -1, which torch reads as the *last* slot, so a base-model
request batched with LoRA requests gets the last slot's adapter applied
(upstream PR vllm#48421). The GPU Triton kernels skip -1; these wrappers give
the CPU ops the same contract by running the original op on the rows that
have an adapter only.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_loraserve._patching import wrap

_BGMV_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _adapter_rows_only(op: Callable) -> Callable:
    """`op(inputs, weights, output, indices, *rest)` applied to rows whose
    index is >= 0; rows with -1 keep their current output."""

    def fixed(inputs, weights, output, indices, *rest, **kw):
        keep = indices >= 0
        if bool(keep.all()):
            return op(inputs, weights, output, indices, *rest, **kw)
        rows = keep.nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        part = output[rows]
        op(inputs[rows], weights, part, indices[rows], *rest, **kw)
        output[rows] = part
        return None

    return fixed


def install() -> None:
    """Patch the ops where they are looked up: `lora_ops` itself (its sgmv_*
    functions call the bgmv_* globals) and `punica_cpu`, which imported them
    by name. Idempotent."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        for name in _BGMV_OPS:
            wrap(module, name, _adapter_rows_only)

