"""The tuned tile table (--loraserve-tiles, kernels/tile_table.py): its file
format, what it refuses, and that its batch classes split batches where the
backend's rules do, so an entry can stand in for a rule's pick."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_loraserve.config import LoraServeConfig
from vllm_loraserve.kernels import get_backend, make_batch
from vllm_loraserve.kernels.batch import JOB_ROWS
from vllm_loraserve.kernels.tile_table import CLASSES, Tiles, TileTable, batch_class, check_tiles
from vllm_loraserve.kernels.triton_mbgmm import expand_tiles, shrink_tiles, stream_tiles

ENTRIES = {("stream", "short", 4096, 3): Tiles(JOB_ROWS, 64, max_regs=48),
           ("expand", "short", 28672, 2): Tiles(64, 32, num_warps=8, num_stages=3),
           ("shrink", "few", 14336, 1): Tiles(32, 128, split_k=16)}
RULES = {"shrink": shrink_tiles, "stream": stream_tiles, "expand": expand_tiles}


def test_a_table_survives_its_file(tmp_path):
    table = TileTable("NVIDIA H200", "3.6.0", ENTRIES)
    path = tmp_path / "tiles.json"
    path.write_text(table.to_json())
    assert TileTable.load(str(path)) == table
    assert LoraServeConfig(tiles=str(path)).tiles == str(path)


def _batches():
    """Batches of 1-300 work blocks (one distinct slot each) of every height
    the pool builds, with ranks (so with jobs)."""
    for blocks in (1, 64, 128, 129, 300):
        for block_m in (16, 32, 64):
            yield make_batch(list(range(blocks)), block_m=block_m, ranks=[16] * blocks)


@pytest.mark.parametrize("op", sorted(RULES))
@pytest.mark.parametrize("size", [1024, 4096, 14336])
def test_each_rule_picks_one_legal_tile_per_batch_class(op, size):
    """An entry replaces a rule's pick for a whole class: the rule must not
    split a class itself (it would then have been tuned per part), and its
    picks must be entries the table takes."""
    picks = {}
    for batch in _batches():
        t = RULES[op](batch, size)
        check_tiles(op, t)
        picks.setdefault(batch_class(batch.max_blocks, batch.block_m), set()).add(t)
    assert set(picks) == set(CLASSES)
    assert all(len(p) == 1 for p in picks.values()), picks


def test_an_entry_is_found_by_class_size_and_count():
    table = TileTable("d", "t", ENTRIES)
    def get(*launch):
        return table.entries.get(TileTable.key(*launch))

    assert get("stream", 700, 16, 4096, 3) == ENTRIES[("stream", "short", 4096, 3)]
    assert get("stream", 700, 16, 4096, 1) is None  # another count
    assert get("stream", 700, 16, 14336, 3) is None  # another size
    assert get("stream", 700, 32, 4096, 3) is None  # another class (tall)
    assert get("expand", 700, 16, 4096, 3) is None  # another op


@pytest.mark.parametrize("op, tiles, why", [
    ("expand", Tiles(256, 16), "divide the panel"),
    ("expand", Tiles(48, 16), "powers of two"),
    ("expand", Tiles(128, 8), "from 16 to 256"),
    ("expand", Tiles(128, 512), "from 16 to 256"),
    ("stream", Tiles(16, 128), "block_n must be 32"),
    ("shrink", Tiles(32, 256), "divide the panel"),
    ("shrink", Tiles(32, 128, split_k=3), "split_k must be 0 .automatic. or a power"),
    ("stream", Tiles(32, 128, split_k=2), "split_k must be 0 for 'stream'"),
    ("expand", Tiles(128, 16, split_k=2), "split_k must be 0 for 'expand'"),
    ("expand", Tiles(128, 16, num_warps=3), "num_warps"),
    ("expand", Tiles(128, 16, num_warps=32), "num_warps"),
    ("expand", Tiles(128, 16, num_stages=0), "num_stages"),
    ("expand", Tiles(128, 16, num_stages=9), "num_stages"),
    ("stream", Tiles(32, 128, max_regs=23), "max_regs must be 0 .the compiler's. or 24"),
    ("stream", Tiles(32, 128, max_regs=256), "max_regs must be 0 .the compiler's. or 24"),
    ("expand", Tiles(128, 16, programs_per_sm=3), "programs_per_sm"),
    ("stream", Tiles(32, 128, programs_per_sm=512), "programs_per_sm"),
    ("expand", Tiles(128, True), "integer"),
    ("gemm", Tiles(128, 16), "op must be one of"),
])
def test_tiles_that_cannot_launch_are_refused(op, tiles, why):
    with pytest.raises(ValueError, match=why):
        check_tiles(op, tiles)
    with pytest.raises(ValueError, match=rf"entry \({op}, short, 4096, 1\): .*{why}"):
        TileTable("d", "t", {(op, "short", 4096, 1): tiles})


@pytest.mark.parametrize("tiles", [Tiles(16, 16), Tiles(256, 128, split_k=16, num_warps=16,
                                                        num_stages=8, programs_per_sm=256)])
def test_the_limits_themselves_are_taken(tiles):
    check_tiles("shrink", tiles)


@pytest.mark.parametrize("op", ["shrink", "stream", "expand"])
def test_a_register_cap_reaches_every_ops_cuda_launch(op):
    """max_regs becomes Triton's maxnreg on CUDA, for every op (the sweep
    searches it for the expand too); elsewhere, and at 0, no cap."""
    from vllm_loraserve.kernels.triton_mbgmm import _options

    t = Tiles(JOB_ROWS, 64, num_warps=8, num_stages=3, max_regs=40)
    check_tiles(op, t)
    assert _options(t, torch.device("cuda")) == dict(num_warps=8, num_stages=3, maxnreg=40)
    assert _options(t, torch.device("cpu")) == dict(num_warps=8, num_stages=3)
    assert "maxnreg" not in _options(Tiles(JOB_ROWS, 64), torch.device("cuda"))


@pytest.mark.parametrize("key, why", [
    (("expand", "huge", 4096, 1), "batch class must be one of"),
    (("expand", "short", 0, 1), "size must be a positive integer"),
    (("expand", "short", 4096, 0), "count must be a positive integer"),
    (("expand", "short", 4096.0, 1), "size must be a positive integer"),
    (("expand", "short", 4096, True), "count must be a positive integer"),
])
def test_keys_that_no_launch_has_are_refused(key, why):
    with pytest.raises(ValueError, match=why):
        TileTable("d", "t", {key: Tiles(128, 16)})


def _row(**change):
    row = dict(op="expand", batch_class="short", size=4096, count=1,
               tiles=dict(block_n=128, block_k=16))
    return {**row, **change}


def _table(*rows):
    return json.dumps({"device": "d", "triton": "t", "entries": list(rows)})


@pytest.mark.parametrize("text, why", [
    ("not json", "is not JSON"),
    (json.dumps({"device": "d", "entries": []}), "not a loraserve tile table.*KeyError: 'triton'"),
    (_table(_row(), _row()), "appears twice"),
    (_table(_row(batch_class="huge")), "batch class must be one of"),
    (_table(_row(tiles=dict(block_n=128, block_k=16, warps=4))),
     "not a loraserve tile table.*unexpected keyword argument 'warps'"),
    (_table(_row(size="wide")), "size must be a positive integer"),
    (_table(_row(size=4096.9)), "size must be a positive integer"),
    (_table(_row(tiles=dict(block_n=256, block_k=16))), "divide the panel"),
])
def test_a_bad_table_stops_the_start_with_its_reason(tmp_path, text, why):
    path = tmp_path / "tiles.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}.*{why}"):
        LoraServeConfig(tiles=str(path))
    with pytest.raises(ValueError, match="cannot read the tile table"):
        LoraServeConfig(tiles=str(tmp_path / "missing.json"))


def test_only_the_triton_kernels_take_a_table():
    with pytest.raises(ValueError, match="tunes the triton kernels"):
        get_backend("torch", TileTable("d", "t", {}))
    assert get_backend("triton", TileTable("d", "t", ENTRIES)).table.entries == ENTRIES


def test_the_worker_takes_the_configured_table_and_says_where_it_was_tuned(tmp_path, caplog,
                                                                            monkeypatch):
    import logging

    import triton

    from vllm_loraserve.worker import paged_manager as pm

    # vLLM's logger keeps its records to its own handler: let them reach caplog's.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)

    manager = pm.PagedWorkerLoRAManager.__new__(pm.PagedWorkerLoRAManager)
    manager.device = torch.device("cpu")
    manager.cfg = LoraServeConfig()
    assert manager._tile_table() is None
    path = tmp_path / "tiles.json"
    for device, version, elsewhere in (("cpu", triton.__version__, False),
                                       ("NVIDIA H200", triton.__version__, True),
                                       ("cpu", "0.0.1", True)):
        path.write_text(TileTable(device, version, ENTRIES).to_json())
        manager.cfg = LoraServeConfig(tiles=str(path))
        caplog.clear()
        with caplog.at_level("INFO", logger=pm.logger.name):
            assert manager._tile_table() == TileTable(device, version, ENTRIES)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(warned) == elsewhere
        if elsewhere:
            assert (f"tuned on {device} with Triton {version}, and this is cpu with Triton "
                    f"{triton.__version__}") in warned[0]


def test_the_worker_warns_when_no_entry_fits_the_models_launches(caplog, monkeypatch):
    """A table tuned for other shapes would leave every tile to the rules
    without a word: the worker says so after the warm-up."""
    import logging
    from types import SimpleNamespace

    from vllm_loraserve.worker import paged_manager as pm

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    manager = pm.PagedWorkerLoRAManager.__new__(pm.PagedWorkerLoRAManager)
    manager.cfg = LoraServeConfig()
    for used, warned in ((set(), True), ({("stream", "short", 4096, 3)}, False)):
        manager.pool = SimpleNamespace(backend=SimpleNamespace(
            table=TileTable("d", "t", ENTRIES), table_keys_used=used))
        caplog.clear()
        with caplog.at_level("INFO", logger=pm.logger.name):
            manager._say_table_use()
        lines = {r.levelname: r.getMessage() for r in caplog.records}
        assert ("no entry of the tile table" in lines.get("WARNING", "")) == warned
        assert ("1 of the table's 3 entries fit" in lines.get("INFO", "")) == (not warned)
    manager.pool = SimpleNamespace(backend=SimpleNamespace(table=None))
    caplog.clear()
    manager._say_table_use()  # no table: nothing to say
    assert not caplog.records
