"""The paged LoRA layers: vLLM's LoRA layer classes, computing from pages.

vLLM's linear LoRA layers (qkv, o, gate_up, down, and the other linear
kinds) call `self.punica_wrapper.add_lora_linear(y, x, ...)` after their base
GEMM. Each wrapped layer gets its own `PagedLinearLoRA` as that wrapper; it
adds the layer's delta through one custom op, `vllm.loraserve_paged_lora`,
which is opaque to torch.compile (its body runs at every call, or once at
CUDA-graph capture) and reads the step's state from the `DevicePool`.

The op's integer argument is the layer's index in a process-wide table,
filled when the model is wrapped (before compilation) and never reordered.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.worker.pool import DevicePool

_LAYERS: list[PagedLinearLoRA] = []


class PagedLinearLoRA:
    """The punica-wrapper stand-in of one vLLM linear LoRA layer."""

    def __init__(self, pool: DevicePool, layer: int, module: ModuleSlices) -> None:
        self.pool, self.layer, self.module = pool, layer, module
        self.key = len(_LAYERS)
        _LAYERS.append(self)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, *_: object,
                        **__: object) -> torch.Tensor:
        torch.ops.vllm.loraserve_paged_lora(y, x, self.key)
        return y


def _paged_lora(y: torch.Tensor, x: torch.Tensor, key: int) -> None:
    layer = _LAYERS[key]
    layer.pool.add_lora(layer.layer, layer.module, x, y)


def _paged_lora_fake(y: torch.Tensor, x: torch.Tensor, key: int) -> None:
    return None


direct_register_custom_op(op_name="loraserve_paged_lora", op_func=_paged_lora,
                          mutates_args=["y"], fake_impl=_paged_lora_fake)
