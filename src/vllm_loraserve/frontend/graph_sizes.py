"""CUDA graphs for every decode step of an engine with the paged pool.

vLLM captures CUDA graphs up to min(2 * max_num_seqs, 512) tokens unless told
otherwise (`VllmConfig._set_cudagraph_sizes`, the same in 0.26 and 0.27). A
step above the largest graph runs eagerly, and each of its LoRA ops is then
launched from Python: about 53 µs of host time per module and layer
(docs/benchmarks/kernels.md, session 19), 12 ms a step at Llama-3-8B with
adapters on all linear layers. On H100 and H200, vLLM's default max_num_seqs
is 1024, so a full batch's decode steps (513 to 1024 sequences) ran eagerly,
paced by the host. There, graphs up to 1024 tokens gave pool-200 1.50x its
throughput (docs/benchmarks/e2e.md, session 20).

So with the paged pool, when the user gave no capture size
(`--max-cudagraph-capture-size`, `--cudagraph-capture-sizes` or the same
keys of `--compilation-config`) and graphs are on, the largest graph holds a
decode step of max_num_seqs sequences, up to MEASURED_CAP tokens. Where
vLLM's default already does, or where `--enforce-eager` set the size to 0,
nothing changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vllm_loraserve._patching import wrap
from vllm_loraserve.config import from_vllm_config

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and format

VLLM_DEFAULT_CAP = 512  # vLLM's largest default graph, whatever max_num_seqs is
STRIDE = 16  # above 256 tokens vLLM captures every 16th size
# Every size above 256 adds a graph (capture time, graph memory). Up to 1024
# tokens the pool's engine started as fast as with vLLM's 512; larger sizes
# are unmeasured, so they stay the user's choice.
MEASURED_CAP = 1024


def _vllm_default(decode_tokens: int) -> int:
    """vLLM's own largest graph for decode steps of up to `decode_tokens`."""
    return min(2 * decode_tokens, VLLM_DEFAULT_CAP)


def decode_capture_size(max_num_seqs: int, decode_query_len: int,
                        max_num_batched_tokens: int) -> int:
    """The largest graph (tokens) that holds every decode step: at least
    vLLM's default, rounded up to vLLM's stride, at most a step's tokens and
    MEASURED_CAP. With speculative decoding vLLM keeps only sizes that are
    multiples of the query length, so the size is one of those too."""
    decode = max_num_seqs * decode_query_len
    step = math.lcm(STRIDE, decode_query_len)
    size = max(_vllm_default(decode), -(-decode // step) * step)
    return min(size, MEASURED_CAP, max_num_batched_tokens)


def cover_decode_steps(vllm_config: Any) -> int | None:
    """Set the compilation config's max capture size for a paged-pool engine
    whose user left it unset; returns the size set, or None."""
    from vllm.config import CUDAGraphMode

    cfg = from_vllm_config(vllm_config)
    cc = vllm_config.compilation_config
    model = vllm_config.model_config
    if (cfg is None or cfg.pool != "paged" or cc.max_cudagraph_capture_size is not None
            or cc.cudagraph_capture_sizes is not None or model is None
            or model.enforce_eager or cc.cudagraph_mode == CUDAGraphMode.NONE):
        return None
    sched = vllm_config.scheduler_config
    query_len = 1 + vllm_config.num_speculative_tokens
    size = decode_capture_size(sched.max_num_seqs, query_len, sched.max_num_batched_tokens)
    if size <= _vllm_default(sched.max_num_seqs * query_len):
        return None  # vLLM's default already holds every decode step
    cc.max_cudagraph_capture_size = size
    logger.info("vllm-loraserve: CUDA graphs up to %d tokens, so that a decode step of "
                "max_num_seqs=%d runs as a graph (--max-cudagraph-capture-size overrides)",
                size, sched.max_num_seqs)
    return size


def _make_set_cudagraph_sizes(set_cudagraph_sizes):
    def patched(self):
        cover_decode_steps(self)
        return set_cudagraph_sizes(self)

    return patched


def install() -> None:
    from vllm.config import VllmConfig

    wrap(VllmConfig, "_set_cudagraph_sizes", _make_set_cudagraph_sizes)
