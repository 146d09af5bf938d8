"""The paged LoRA layers: vLLM's LoRA layer classes, computing from pages.

vLLM's linear LoRA layers (qkv, o, gate_up, down, and the other linear
kinds) call `self.punica_wrapper.add_lora_linear(y, x, ...)` after their base
GEMM. Each wrapped layer gets its own `PagedLinearLoRA` as that wrapper; it
adds the layer's delta through one custom op, `vllm.loraserve_paged_lora`,
which is opaque to torch.compile (its body runs at every call, or once at
CUDA-graph capture) and reads the step's state from the `DevicePool`.

The op names its layer by a tensor of its own, a one-element `key` whose
address is the layer's entry in a process-wide table (filled when the model
is wrapped, before compilation). A tensor, not an integer: torch.compile
lifts tensors as graph inputs, so every decoder layer's piece of the graph
is the same graph and Inductor compiles it once. An integer is a constant
in the graph: each layer's piece differs, and each compiles on its own
(53-59 s of compilation at 32 layers against stock LoRA's 11 s, on an H200).
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.worker.pool import DevicePool

# key.data_ptr() -> its layer. The table holds every wrapper (and so its key)
# for the process's life: no key is freed, so no two share an address.
_LAYERS: dict[int, PagedLinearLoRA] = {}


class PagedLinearLoRA:
    """The punica-wrapper stand-in of one vLLM linear LoRA layer."""

    def __init__(self, pool: DevicePool, layer: int, module: ModuleSlices) -> None:
        self.pool, self.layer, self.module = pool, layer, module
        # On the pool's device, as the graph's other inputs.
        self.key = torch.zeros(1, dtype=torch.int8, device=pool.device)
        _LAYERS[self.key.data_ptr()] = self

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, *_: object,
                        **__: object) -> torch.Tensor:
        torch.ops.vllm.loraserve_paged_lora(y, x, self.key)
        return y


def _paged_lora(y: torch.Tensor, x: torch.Tensor, key: torch.Tensor) -> None:
    layer = _LAYERS[key.data_ptr()]  # the address only: no read of the device
    layer.pool.add_lora(layer.layer, layer.module, x, y)


def _paged_lora_fake(y: torch.Tensor, x: torch.Tensor, key: torch.Tensor) -> None:
    return None


direct_register_custom_op(op_name="loraserve_paged_lora", op_func=_paged_lora,
                          mutates_args=["y"], fake_impl=_paged_lora_fake)
