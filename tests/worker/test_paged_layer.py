"""The paged LoRA op as torch.compile sees it (worker/paged_layer.py)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from vllm_loraserve.worker.paged_layer import PagedLinearLoRA


class RecordingPool:
    """The one pool method the op calls: it records the layer and adds it to y."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[int] = []

    def add_lora(self, layer: int, module: object, x: torch.Tensor, y: torch.Tensor) -> None:
        self.calls.append(layer)
        y += layer


def test_every_layer_is_one_graph_to_torch_compile_and_each_call_reaches_its_layer():
    """A layer is named by a tensor input, not a constant: one layer's forward
    compiles once for all layers (vLLM's pieces of the model are then the
    same graph, which Inductor compiles once; an integer key compiled each
    layer's piece on its own), and each call still reaches its own layer."""
    pool = RecordingPool()
    layers = [PagedLinearLoRA(pool, i, None) for i in range(4)]
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def forward(wrapper: PagedLinearLoRA, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        wrapper.add_lora_linear(y, x, None, None, 1.0, ())
        return y

    x = torch.ones(3, 2)
    for i, wrapper in enumerate(layers):
        torch.testing.assert_close(forward(wrapper, x), torch.full((3, 2), 2.0 + i))
    assert pool.calls == [0, 1, 2, 3]
    assert counter.frame_count == 1
