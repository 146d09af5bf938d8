"""Directories of PEFT adapter directories."""

from __future__ import annotations

import os

import torch

from vllm_loraserve.adapters.directory import scan_adapter_dir, scan_adapter_dirs
from vllm_loraserve.adapters.peft import write_adapter
from vllm_loraserve.adapters.record import AdapterRecord


def _adapter(path, rank=4):
    w = {"model.layers.0.self_attn.q_proj": (torch.ones(rank, 8), torch.ones(8, rank))}
    write_adapter(str(path), w, rank=rank, alpha=2 * rank, base_model="b")
    return str(path)


def test_scan_lists_every_visible_subdirectory(tmp_path):
    _adapter(tmp_path / "b")
    os.makedirs(tmp_path / "a-empty")
    os.makedirs(tmp_path / ".hidden")
    (tmp_path / "file.txt").write_text("x")
    assert [n for n, _ in scan_adapter_dir(str(tmp_path))] == ["a-empty", "b"]


def test_scan_dirs_checks_each_name_once_first_root_wins(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _adapter(first / "x", rank=4)
    _adapter(second / "x", rank=8)  # shadowed by first/x
    _adapter(second / "y", rank=8)
    os.makedirs(second / "empty")
    _adapter(second / "bad name", rank=8)  # not a safe identifier
    valid, invalid = scan_adapter_dirs([str(first), str(second), str(tmp_path / "missing")])
    assert valid == [AdapterRecord("x", 4), AdapterRecord("y", 8)]
    assert sorted(invalid) == ["bad name", "empty"]
    assert "adapter_config.json" in invalid["empty"]
