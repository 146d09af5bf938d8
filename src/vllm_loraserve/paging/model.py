"""The page layout of a served model, from its config alone.

The scheduler (engine core process) counts an adapter's pages and the workers
write and read them; both must use the same `LayerLayout`. The scheduler has
no model, only its config, so the layout is a pure function of the HF text
config and the KV page size. Workers check it against the LoRA layers they
really built (worker/paged_manager.py) and refuse to start on a mismatch.

Slices follow a dense decoder layer in a fixed order (q, k, v, o, gate, up,
down), so vLLM's packed layers (qkv_proj: q, k, v; gate_up_proj: gate, up)
are consecutive slices sharing one input, as `ModuleSlices` requires.
"""

from __future__ import annotations

from typing import Any

from vllm_loraserve.paging.layout import LayerLayout, SliceSpec

DECODER_SLICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM's packed LoRA layers and the PEFT modules they hold, in slice order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def decoder_slices(text_config: Any) -> tuple[SliceSpec, ...]:
    """(in, out) of each adaptable linear map of one decoder layer (TP = 1)."""
    hidden = text_config.hidden_size
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    inter = text_config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}
    return tuple(SliceSpec(n, *dims[n]) for n in DECODER_SLICES)


def model_layout(text_config: Any, page_size: int) -> LayerLayout:
    """The layout for a model whose KV page holds `page_size` adapter elements."""
    return LayerLayout(decoder_slices(text_config), page_size)


def module_slice_names(short_name: str) -> tuple[str, ...]:
    """PEFT slice names computed by the vLLM LoRA layer `short_name`."""
    return PACKED.get(short_name, (short_name,))


def max_file_bytes(text_config: Any, rank: int) -> int:
    """The most bytes of tensors a PEFT weights file of rank `rank` holds for
    the pool (the host tier's arena sizes its chunks by it): A [rank, in] and
    B [out, rank] of every decoder slice in every layer, in float32 (the
    widest dtype adapters/peft.py reads)."""
    per_layer = sum(s.in_features + s.out_features for s in decoder_slices(text_config))
    return text_config.num_hidden_layers * rank * per_layer * 4
