"""Without CUDA the csrc/ op is unavailable, says why, and says so once."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_loraserve.worker import assist_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")


def test_unavailable_without_cuda_with_a_reason(caplog, monkeypatch):
    ok, reason = assist_ops.available()
    assert not ok and ("not a CUDA build" in reason or "no CUDA device" in reason)
    with pytest.raises(assist_ops.AssistOpsUnavailable, match="unavailable"):
        assist_ops.ops()
    monkeypatch.setattr(assist_ops, "_logged", False)
    logger = logging.getLogger(assist_ops.logger.name)
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger=assist_ops.logger.name):
        assist_ops.log_availability()
        assist_ops.log_availability()
    lines = [r.getMessage() for r in caplog.records if "CPU-assist op" in r.getMessage()]
    assert lines == [f"loraserve: sync-free CPU-assist op unavailable ({reason}); the engine "
                     f"runs without it"]


def test_the_source_is_where_the_jit_build_looks():
    assert assist_ops.SOURCE.is_file()
    assert "TORCH_LIBRARY(loraserve_assist" in assist_ops.SOURCE.read_text()
