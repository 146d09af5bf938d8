"""benchmarks/kernels/engine_grid.py's sweep and its tile table (--tiles-out),
on CPU with a fake timer: what it searches (the stream-K shrink the pool's
steps launch, then the expand), the keys of its picks, and one pick for
o_proj's and down_proj's expand, which are one launch."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

from vllm_loraserve.kernels import triton_mbgmm as mbgmm
from vllm_loraserve.kernels.tile_table import Tiles, TileTable, batch_class
from vllm_loraserve.paging.layout import pack_layer
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.worker.pool import DevicePool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "kernels"))
import engine_grid  # noqa: E402

sys.path.pop(0)

CFG = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=96, num_hidden_layers=2)
# What the fake timer rewards: a value of each axis the sweep has.
FAST_STREAM = dict(num_warps=8, num_stages=3, programs_per_sm=16)
FAST_EXPAND = dict(block_k=32, num_stages=1, max_regs=40, programs_per_sm=64)


def _pool(tokens):
    layout = model_layout(CFG, 1024)
    pool = DevicePool(layout.slices, 2, max_rank=32, max_tokens=tokens, max_slots=8,
                      max_slices=3, backend="torch", device=torch.device("cpu"))
    pool.bind([torch.zeros(80, 2, 16, 32) for _ in range(2)])
    names = [s.name for s in layout.slices]
    p = layout.place(16, names)
    w = {s.name: (torch.randn(16, s.in_features), torch.randn(s.out_features, 16))
         for s in layout.slices}
    stream = pack_layer(layout, p, w, 0.5, torch.float32)
    pool.load(0, 1, p, tuple(range(1, 1 + p.num_pages)), stream.expand(2, -1).contiguous())
    pool.set_tokens(np.ones(tokens, dtype=np.int64), set())
    return pool


def test_the_sweep_finds_the_fastest_tiles_and_keys_them_as_the_server_looks_up(monkeypatch):
    timed = []

    def time_module(pool, kind, tokens, dev, eager=False):
        b = pool.backend
        probe = engine_grid.probe_batch(pool, tokens)
        m = engine_grid.ModuleSlices.of(pool.layout, engine_grid.MODULES[kind])
        stream = b._tiles("stream", probe, m.in_features, m.count)
        expand = b._tiles("expand", probe, max(m.out_features), m.count)
        timed.append((kind, stream, expand))
        us = 100.0 - sum(getattr(stream, k) == v for k, v in FAST_STREAM.items()) \
            - sum(getattr(expand, k) == v for k, v in FAST_EXPAND.items())
        return us, torch.zeros(1)

    monkeypatch.setattr(engine_grid, "time_module", time_module)
    pool = _pool(tokens=2100)  # 140 blocks at most: class short
    rows = {}
    got = {kind: engine_grid.sweep(pool, kind, 2100, "cpu", mbgmm, print, rows)
           for kind in ("o", "down")}
    probe = engine_grid.probe_batch(pool, 2100)
    cls = batch_class(probe.max_blocks, probe.block_m)
    assert cls == "short"
    rule_stream = mbgmm.stream_tiles(probe, 64)
    rule_expand = mbgmm.expand_tiles(probe, 64)
    want_stream = Tiles(**{**rule_stream.__dict__, **FAST_STREAM})
    want_expand = Tiles(**{**rule_expand.__dict__, **FAST_EXPAND})
    assert rows == {("stream", cls, 64, 1): want_stream,   # o_proj: K 64
                    ("stream", cls, 96, 1): Tiles(**{**mbgmm.stream_tiles(probe, 96).__dict__,
                                                     **FAST_STREAM}),  # down_proj: K 96
                    ("expand", cls, 64, 1): want_expand}  # both: N 64, one slice
    assert got["o"]["swept"] == ["stream", "expand"] and got["down"]["swept"] == ["stream"]
    assert all(e == want_expand for kind, _, e in timed if kind == "down")  # o's pick
    assert all(engine_grid.check_tiles("stream", s) is None and
               engine_grid.check_tiles("expand", e) is None for _, s, e in timed)
    table = TileTable("cpu", "any", rows)
    assert TileTable.from_json(table.to_json()) == table
    assert table.entries[TileTable.key("expand", probe.max_blocks, probe.block_m, 64, 1)] == \
        want_expand


def test_the_sweep_refuses_a_table_of_two_picks_per_class_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(engine_grid, "copy_tb_s", lambda dev: 1 / 0)  # the first GPU work
    for tokens, why in (("256,1024", "1024 and 256 tokens are both batch class 'short'"),
                        ("64,8192", "8192 tokens make 2 batchings")):
        monkeypatch.setattr(sys, "argv", ["engine_grid.py", "--sweep", "--mixes", "pow-200",
                                          "--tokens", tokens, "--tiles-out", "t.json",
                                          "--out", "o.json"])
        try:
            engine_grid.main()
        except SystemExit as e:
            assert why in str(e)
        else:
            raise AssertionError("not refused")
