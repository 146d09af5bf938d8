"""--loraserve-pack triton on the engine's side (the packing itself:
tests/kernels/test_pack.py; on a GPU: tests/gpu/test_load_sync_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_loraserve.paging.layout import PACK_COLUMNS
from vllm_loraserve.worker.pack_tables import TablePacker, file_table

from .test_cold_start import LAYERS, LAYOUT, host_adapter


def test_a_read_files_table_has_a_row_per_layer_and_segment(tmp_path):
    entry = host_adapter(tmp_path, "a", 8, ("q_proj", "down_proj"), 1)
    table = file_table(LAYOUT, LAYERS, entry.placement, entry.weights, entry.where)
    assert table.shape == (LAYERS * 2 * 2, len(PACK_COLUMNS))
    assert sorted(set(table[:, 0].tolist())) == list(range(LAYERS))
    q, down = LAYOUT.slice_index("q_proj"), LAYOUT.slice_index("down_proj")
    assert set(table[:, 4].tolist()) == {entry.placement.seg_offsets[s]
                                         for s in (2 * q, 2 * q + 1, 2 * down, 2 * down + 1)}


def test_it_refuses_a_device_without_cuda():
    with pytest.raises(ValueError, match="--loraserve-pack triton packs on a CUDA device"):
        TablePacker(LAYOUT, LAYERS, torch.bfloat16, torch.device("cpu"))
