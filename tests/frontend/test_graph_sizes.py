"""With the paged pool, vLLM's CUDA graphs hold every decode step
(frontend/graph_sizes.py). vLLM's own `_set_cudagraph_sizes` computes the
sizes here, on a real VllmConfig built on this CPU machine with its graph
mode switched on as a GPU platform would have it."""

from __future__ import annotations

import os

import pytest

from vllm_loraserve.frontend.graph_sizes import cover_decode_steps, decode_capture_size


@pytest.mark.parametrize("seqs, query_len, tokens, size", [
    (1024, 1, 16384, 1024),  # H100/H200 defaults: vLLM's own would be 512
    (1000, 1, 16384, 1008),  # rounded up to vLLM's stride of 16 above 256
    (64, 1, 8192, 128),  # vLLM's default (2 * max_num_seqs) already holds them
    (1024, 1, 768, 768),  # never above a step's tokens
    (256, 3, 16384, 768),  # speculative decoding: 3 tokens per sequence
    (200, 3, 16384, 624),  # ... and a multiple of 3 (vLLM drops other sizes there)
    (2048, 1, 16384, 1024),  # larger graphs were not measured: left to the user
])
def test_decode_capture_size(seqs, query_len, tokens, size):
    assert decode_capture_size(seqs, query_len, tokens) == size


def _graph_config(tiny_assets, extra, max_num_seqs=1024, **compilation):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_loraserve.plugin import install

    install()
    vc = EngineArgs(model=os.path.join(tiny_assets, "model"), enable_lora=True,
                    max_num_seqs=max_num_seqs, additional_config=extra).create_engine_config()
    # The CPU platform turns graphs off; a GPU one leaves them on, with the
    # sizes unset unless the user gave them.
    cc = vc.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    cc.max_cudagraph_capture_size = compilation.get("max_cudagraph_capture_size")
    cc.cudagraph_capture_sizes = compilation.get("cudagraph_capture_sizes")
    vc.scheduler_config.max_num_batched_tokens = 16384
    vc._set_cudagraph_sizes()
    return cc


def test_paged_pool_graphs_hold_a_full_decode_step(tiny_assets):
    cc = _graph_config(tiny_assets, {"loraserve": {}})
    assert cc.max_cudagraph_capture_size == 1024
    assert cc.cudagraph_capture_sizes[-1] == 1024


@pytest.mark.parametrize("extra, compilation, largest", [
    ({}, {}, 512),  # no plugin: stock vLLM
    ({"loraserve": {"pool": "vllm"}}, {}, 512),  # vLLM's own LoRA slots
    ({"loraserve": {}}, {"max_cudagraph_capture_size": 256}, 256),  # the user's size wins
    ({"loraserve": {}}, {"cudagraph_capture_sizes": [1, 8, 640]}, 640),
])
def test_sizes_left_to_vllm_or_the_user(tiny_assets, extra, compilation, largest):
    cc = _graph_config(tiny_assets, extra, **compilation)
    assert cc.cudagraph_capture_sizes[-1] == largest


def test_small_batches_keep_vllms_default(tiny_assets):
    cc = _graph_config(tiny_assets, {"loraserve": {}}, max_num_seqs=64)
    assert cc.cudagraph_capture_sizes[-1] == 128


def test_eager_engines_are_left_alone(tiny_assets):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    vc = EngineArgs(model=os.path.join(tiny_assets, "model"), enable_lora=True,
                    max_num_seqs=1024, enforce_eager=True,
                    additional_config={"loraserve": {}}).create_engine_config()
    cc = vc.compilation_config
    # Only --enforce-eager stands between this config and a size.
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes = None
    assert cover_decode_steps(vc) is None
    vc.model_config.enforce_eager = False
    assert cover_decode_steps(vc) == decode_capture_size(
        1024, 1, vc.scheduler_config.max_num_batched_tokens)
