"""Directories of PEFT adapter directories."""

from __future__ import annotations

import os

import torch

from vllm_loraserve.adapters.directory import invalid_lines, scan_adapter_dir, scan_adapter_dirs
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


def test_scan_lists_every_broken_adapter_as_invalid_and_goes_on(tmp_path):
    """No adapter file, however malformed, stops a scan (start-up): each is
    listed invalid with its reason, the others are served."""
    from tests.adapters.test_peft import CONFIG_DAMAGE, DEEP

    root, outside = tmp_path / "root", tmp_path / "outside"
    _adapter(root / "good")
    for damage, (data, _) in CONFIG_DAMAGE.items():
        _adapter(root / f"cfg-{damage}")
        (root / f"cfg-{damage}" / "adapter_config.json").write_bytes(data)
    for damage, header in {"deep": DEEP, "list": b"[1]", "huge": None}.items():
        path = _adapter(root / f"st-{damage}")
        n = (1 << 62) if header is None else len(header)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(n.to_bytes(8, "little") + (header or b""))
    _adapter(outside / "leak")
    _adapter(root / "file-link")
    os.remove(root / "file-link" / "adapter_config.json")
    os.symlink(outside / "leak" / "adapter_config.json", root / "file-link" / "adapter_config.json")
    os.symlink(outside / "leak", root / "dir-link")
    valid, invalid = scan_adapter_dirs([str(root)])
    assert valid == [AdapterRecord("good", 4)]
    assert sorted(invalid) == sorted({*(f"cfg-{d}" for d in CONFIG_DAMAGE), "st-deep", "st-list",
                                      "st-huge", "file-link", "dir-link"})
    assert "its file 'adapter_config.json' resolves to" in invalid["file-link"]
    assert "outside the adapter roots" in invalid["file-link"] and \
        "outside the adapter roots" in invalid["dir-link"]


def test_invalid_lines_are_capped_with_a_count():
    invalid = {f"a{i:02}": f"reason {i}" for i in range(25)}
    lines = invalid_lines(invalid, limit=20)
    assert lines[:2] == ["adapter 'a00' is not served: reason 0",
                         "adapter 'a01' is not served: reason 1"]
    assert len(lines) == 21 and lines[-1] == "... and 5 more invalid adapters"
    assert invalid_lines(dict(list(invalid.items())[:20]), limit=20)[-1] == \
        "adapter 'a19' is not served: reason 19"
    assert invalid_lines({}) == []
