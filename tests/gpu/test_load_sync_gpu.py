"""A page load only queues work: nothing on the engine thread's load path
waits for the GPU (marker `gpu`; run through the device tool).

A load runs before the step's forward pass, while the previous step may
still run on the GPU. A call that waits for the device there stalls the
engine for the rest of that step: `SlotTable.clear`'s scalar assignment did,
~68 ms a load in the e2e protocol (benchmarks/e2e/load_host_time.py). torch's
sync debug mode raises on every synchronizing torch call.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_loraserve.paging.layout import pack_layers
from vllm_loraserve.worker import pack_tables
from vllm_loraserve.worker.pack_tables import TablePacker, file_table
from vllm_loraserve.worker.pool import DevicePool

from ..worker.test_cold_start import KV_SHAPE, LAYERS, LAYOUT, MODULES, host_adapter, page_ids

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
DTYPE = torch.bfloat16


@pytest.mark.parametrize("pack", ["torch", "triton"])  # --loraserve-pack
def test_page_loads_and_evictions_never_wait_for_the_device(tmp_path, pack):
    entry = host_adapter(tmp_path, "a", 16, ("q_proj", "v_proj", "down_proj"), 1, pin=True)
    kv = [torch.zeros(KV_SHAPE, dtype=DTYPE, device=DEV) for _ in range(LAYERS)]
    pool = DevicePool(LAYOUT.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                      max_slices=3, backend="triton", device=DEV)
    pool.bind(kv)
    pool.warm_up(set(MODULES))
    tables = None
    if pack == "triton":
        tables = TablePacker(LAYOUT, LAYERS, DTYPE, DEV)
        tables.warm_up()
        entry = dataclasses.replace(entry, pack_table=file_table(
            LAYOUT, LAYERS, entry.placement, entry.weights, entry.where))

    def load(slot: int) -> None:  # as worker/paged_manager.py `_load`
        data = entry.weights.data.to(DEV, non_blocking=True)
        if tables is not None:
            streams = tables.pack(entry, data, range(LAYERS))
        else:
            streams = pack_layers(LAYOUT, entry.placement,
                                  entry.layer_weights(range(LAYERS), data), entry.scaling, DTYPE)
        pool.load(slot, 1, entry.placement, page_ids(entry, 1), streams)

    load(0)
    torch.cuda.synchronize()  # every kernel of a load has launched once
    torch.cuda._sleep(50_000_000)  # the device busy, as with a step in flight
    torch.cuda.set_sync_debug_mode("error")
    try:
        load(0)  # into a held slot: evicts it first
        pool.hide(0)
        pool.show(0)
        pool.evict(0)
        load(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert pool.slot_of == {1: 1}
    assert int(pool.table.rank[0]) == 0 and int(pool.table.rank[1]) == 16
    assert (pool.table.seg_offsets[0] == -1).all()


@pytest.mark.parametrize("file_dtype, out_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
    (torch.float16, torch.float32)])
def test_one_launch_packs_bit_for_bit_as_torch(tmp_path, file_dtype, out_dtype):
    """--loraserve-pack triton writes the streams pack_layers writes, every
    bit, for a whole load and for a layer group's (cold starts), with a
    scaling whose products round (Bt is rounded to the file's dtype first,
    as torch's product is); its first table goes through the pinned staging
    rows, later ones are kept."""
    entry = host_adapter(tmp_path, "a", 24, ("q_proj", "v_proj", "down_proj"), 3, pin=True)
    raw = entry.weights
    if file_dtype != torch.float32:  # the files hold fp32: their bytes as file_dtype
        tensors = raw.tensors()
        assert all(t.dtype == torch.float32 for ab in tensors.values() for t in ab)
        data = torch.empty_like(raw.data).pin_memory()
        modules = {}
        at = 0
        for name, ab in tensors.items():
            parts = []
            for t in ab:
                b = t.to(file_dtype).contiguous().view(-1).view(torch.uint8)
                data[at:at + b.numel()] = b
                parts.append(type(raw.modules[name][0])(at, tuple(t.shape), file_dtype))
                at += b.numel()
            modules[name] = tuple(parts)
        raw = type(raw)(data, modules)
    entry = dataclasses.replace(entry, weights=raw, scaling=0.3, pack_table=file_table(
        LAYOUT, LAYERS, entry.placement, raw, entry.where))
    tables = TablePacker(LAYOUT, LAYERS, out_dtype, DEV)
    tables.warm_up()
    data = entry.weights.data.to(DEV)
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    for layers in (range(LAYERS), range(2, 5), range(LAYERS)):
        want = pack_layers(LAYOUT, entry.placement, entry.layer_weights(layers, data),
                           entry.scaling, out_dtype)
        got = tables.pack(entry, data, layers)
        assert torch.equal(got.view(bits), want.view(bits)), layers


def test_a_busy_staging_row_is_not_waited_for(monkeypatch):
    """A new table whose staging row's last copy has not completed is not
    copied (the load is packed with torch): the engine thread never waits."""
    monkeypatch.setattr(pack_tables, "STAGING_ROWS", 1)
    tables = TablePacker(LAYOUT, LAYERS, DTYPE, DEV)
    first, second = (np.array([[0, 0, n, 0, 0]], dtype=np.int64) for n in (1, 2))
    torch.cuda._sleep(100_000_000)  # the device busy: the first copy queues behind it
    assert tables._table(first) is not None
    assert tables._table(second) is None
    assert tables._table(first) is not None  # kept: no copy
    torch.cuda.synchronize()
    assert tables._table(second) is not None
