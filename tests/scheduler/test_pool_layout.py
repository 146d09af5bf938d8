"""`pool_layout` refuses the parallel settings the pool cannot serve, with
a message that names the way out, before any page is placed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.worker.test_pool import CFG
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.scheduler.scheduler import pool_layout


def config(**parallel):
    settings = dict(tensor_parallel_size=1, pipeline_parallel_size=1, use_ubatching=False)
    return SimpleNamespace(parallel_config=SimpleNamespace(**{**settings, **parallel}),
                           model_config=SimpleNamespace(hf_text_config=CFG))


@pytest.mark.parametrize("parallel, match", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(use_ubatching=True), "micro-batching")])  # --enable-dbo: two streams interleave
def test_unsupported_parallelism_is_refused(parallel, match):
    with pytest.raises(ValueError, match=f"{match}.*--loraserve-pool vllm"):
        pool_layout(config(**parallel), 1024)


def test_one_worker_gets_the_models_layout():
    assert pool_layout(config(), 1024).slices == model_layout(CFG, 1024).slices
