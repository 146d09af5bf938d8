"""The tuned tile table (--loraserve-tiles, kernels/tile_table.py): its file
format, what it refuses, and that the rules' own tiles are tiles it takes."""

from __future__ import annotations

import json

import pytest

from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.kernels import get_backend, make_batch
from vllm_loraserve.kernels.batch import JOB_ROWS
from vllm_loraserve.kernels.tile_table import Tiles, TileTable, batch_class, check_tiles, table_row
from vllm_loraserve.kernels.triton_mbgmm import expand_tiles, shrink_tiles, stream_tiles

ENTRIES = {("stream", "short", 4096, 3): Tiles(JOB_ROWS, 64, max_regs=48),
           ("expand", "short", 28672, 2): Tiles(64, 32, num_warps=8, num_stages=3),
           ("shrink", "few", 14336, 1): Tiles(32, 128, split_k=16)}


def test_a_table_survives_its_file(tmp_path):
    table = TileTable("NVIDIA H200", "3.6.0", ENTRIES)
    path = tmp_path / "tiles.json"
    path.write_text(table.to_json())
    assert TileTable.load(str(path)) == table
    assert LoraServeConfig(tiles=str(path)).tiles == str(path)


def test_batch_classes_split_as_the_rules_do():
    assert [batch_class(b, m) for b, m in ((1, 16), (128, 64), (129, 16), (4096, 16),
                                           (129, 32))] == ["few", "few", "short", "short",
                                                           "tall"]
    assert TileTable("d", "t", ENTRIES).get("stream", 700, 16, 4096, 3) == ENTRIES[
        ("stream", "short", 4096, 3)]
    assert TileTable("d", "t", ENTRIES).get("stream", 700, 16, 4096, 1) is None  # other count


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (300, 16), (3000, 16), (3000, 64)])
@pytest.mark.parametrize("size", [1024, 4096, 14336])
def test_the_rules_tiles_are_legal_entries(tokens, block_m, size):
    batch = make_batch([0] * tokens, block_m=block_m, ranks=[64])
    check_tiles("shrink", shrink_tiles(batch, size))
    check_tiles("stream", stream_tiles(batch, size))
    check_tiles("expand", expand_tiles(batch, size))


@pytest.mark.parametrize("op, tiles, why", [
    ("expand", Tiles(256, 16), "divide the panel"),
    ("expand", Tiles(48, 16), "powers of two"),
    ("expand", Tiles(128, 8), "at least 16"),
    ("stream", Tiles(16, 128), "block_n must be 32"),
    ("shrink", Tiles(32, 256), "divide the panel"),
    ("shrink", Tiles(32, 128, split_k=3), "split_k"),
    ("expand", Tiles(128, 16, num_warps=3), "num_warps"),
    ("expand", Tiles(128, 16, num_stages=0), "num_stages"),
    ("stream", Tiles(32, 128, max_regs=300), "max_regs"),
    ("expand", Tiles(128, True), "integer"),
    ("gemm", Tiles(128, 16), "op must be one of"),
])
def test_tiles_that_cannot_launch_are_refused(op, tiles, why):
    with pytest.raises(ValueError, match=why):
        check_tiles(op, tiles)
    with pytest.raises(ValueError, match=why):
        TileTable("d", "t", {(op, "short", 4096, 1): tiles})


def _row(**change):
    row = dict(op="expand", batch_class="short", size=4096, count=1,
               tiles=dict(block_n=128, block_k=16))
    return {**row, **change}


@pytest.mark.parametrize("text, why", [
    ("not json", "JSONDecodeError"),
    (json.dumps({"device": "d", "entries": []}), "KeyError: 'triton'"),
    (json.dumps({"device": "d", "triton": "t", "entries": [_row(), _row()]}), "twice"),
    (json.dumps({"device": "d", "triton": "t", "entries": [_row(batch_class="huge")]}),
     "class must be one of"),
    (json.dumps({"device": "d", "triton": "t",
                 "entries": [_row(tiles=dict(block_n=128, block_k=16, warps=4))]}),
     "unexpected keyword argument 'warps'"),
    (json.dumps({"device": "d", "triton": "t", "entries": [_row(size="wide")]}),
     "invalid literal"),
])
def test_a_bad_table_stops_the_start_with_its_reason(tmp_path, text, why):
    path = tmp_path / "tiles.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="is not a loraserve tile table") as e:
        LoraServeConfig(tiles=str(path))
    assert why in str(e.value)
    with pytest.raises(ValueError, match="cannot read the tile table"):
        LoraServeConfig(tiles=str(tmp_path / "missing.json"))


def test_a_sweeps_picks_make_one_entry_per_key():
    rows = {}
    table_row(rows, "expand", 700, 16, 4096, 1, Tiles(64, 32))
    table_row(rows, "expand", 900, 16, 4096, 1, Tiles(64, 32))  # the same pick: kept
    assert rows == {("expand", "short", 4096, 1): Tiles(64, 32)}
    with pytest.raises(ValueError, match="one token count per batch class"):
        table_row(rows, "expand", 900, 16, 4096, 1, Tiles(128, 16))


def test_only_the_triton_kernels_take_a_table():
    with pytest.raises(ValueError, match="tunes the triton kernels"):
        get_backend("torch", TileTable("d", "t", {}))
    assert get_backend("triton", TileTable("d", "t", ENTRIES))._table.entries == ENTRIES
