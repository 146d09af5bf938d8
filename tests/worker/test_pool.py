"""DevicePool: adapters written into KV-shaped tensors, computed per layer,
against dense math."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.paging.layout import pack_layer
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.worker import pool as pool_mod
from vllm_loraserve.worker.paged_layer import PagedLinearLoRA
from vllm_loraserve.worker.pool import DevicePool, page_view

CFG = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=96, num_hidden_layers=2)
KV_SHAPE = (80, 2, 16, 32)  # blocks, kv heads, block size, 2 * head size: 1024-element pages
LAYERS = 2


def adapter(rank, targets, seed):
    g = torch.Generator().manual_seed(seed)
    layout = model_layout(CFG, 1024)
    placement = layout.place(rank, targets)
    weights = []  # per layer: name -> (A, B)
    for _ in range(LAYERS):
        w = {}
        for t in targets:
            s = layout.slices[layout.slice_index(t)]
            w[t] = (torch.randn(rank, s.in_features, generator=g),
                    torch.randn(s.out_features, rank, generator=g))
        weights.append(w)
    streams = torch.stack([pack_layer(layout, placement, w, 0.5, torch.float32)
                           for w in weights])
    return placement, streams, weights


def make_pool():
    layout = model_layout(CFG, 1024)
    pool = DevicePool(layout.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                      max_slices=3, backend="torch", device=torch.device("cpu"))
    kv = [torch.randn(KV_SHAPE) for _ in range(LAYERS)]  # pages start as garbage KV
    pool.bind(kv)
    return pool, kv


def test_paged_layers_match_dense_math_and_skip_tokens_without_adapter():
    pool, kv = make_pool()
    a = adapter(8, ("q_proj", "k_proj", "v_proj", "down_proj"), 0)
    b = adapter(32, ("q_proj", "v_proj", "o_proj"), 1)
    pool.load(3, 11, a[0], tuple(range(5, 5 + a[0].num_pages)), a[1])
    pool.load(0, 12, b[0], tuple(range(20, 20 + b[0].num_pages)), b[1])
    tokens = np.array([11, 0, 12, 12, 7, 11, 0])  # 7: a warm-up dummy
    pool.set_tokens(tokens, ignored_ids={7})
    qkv = ModuleSlices.of(pool.layout, ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(len(tokens), 64)
    for layer in range(LAYERS):
        y0 = torch.randn(len(tokens), sum(qkv.out_features))
        y = PagedLinearLoRA(pool, layer, qkv).add_lora_linear(y0.clone(), x, None, None, 1.0, ())
        want = y0.clone()
        for t, lid in enumerate(tokens):
            w = {11: a[2], 12: b[2]}.get(int(lid))
            if w is None:
                continue
            for name, col, n in zip(("q_proj", "k_proj", "v_proj"), qkv.out_offsets,
                                    qkv.out_features, strict=True):
                if name in w[layer]:
                    A, B = w[layer][name]
                    want[t, col:col + n] += 0.5 * (x[t] @ A.T @ B.T)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(y[[1, 4, 6]], y0[[1, 4, 6]])  # no adapter: untouched
    pool.set_tokens(np.array([0, 7]), ignored_ids={7})  # no adapter: not an adapter step
    pool.set_tokens(np.array([12, 12]), ignored_ids={7})
    # Steps with adapters, their distinct adapters and rank sums (8 + 32, then 32).
    assert (pool.adapter_steps, pool.adapter_step_adapters, pool.adapter_step_ranks) == (2, 3, 72)
    # The bytes of A and B those steps' adapters hold in every layer.
    assert pool.adapter_step_bytes == (held_bytes(8, ("q_proj", "k_proj", "v_proj", "down_proj"))
                                       + 2 * held_bytes(32, ("q_proj", "v_proj", "o_proj")))


def held_bytes(rank, targets):
    """Bytes of A and B a rank-`rank` adapter on `targets` holds in every
    layer of CFG (fp32 pages here), from the modules' (in, out) shapes."""
    dims = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
            "down_proj": (96, 64)}
    return sum(rank * sum(dims[t]) for t in targets) * LAYERS * 4


def test_step_bytes_follow_what_each_slot_holds_now():
    """A slot's bytes are counted when it is written: a slot written again
    with another adapter, or cleared and written, counts its new adapter's."""
    pool, _ = make_pool()
    small, large = ("q_proj", "down_proj"), ("q_proj", "k_proj", "v_proj", "o_proj")
    a, b = adapter(8, small, 5), adapter(16, large, 6)  # 8 and 32 pages
    pool.load(3, 11, a[0], tuple(range(5, 5 + a[0].num_pages)), a[1])
    pool.set_tokens(np.array([11, 11, 0]), set())
    pool.load(3, 12, b[0], tuple(range(5, 5 + b[0].num_pages)), b[1])  # replaces 11
    pool.set_tokens(np.array([12]), set())
    pool.evict(3)
    pool.load(3, 13, a[0], tuple(range(40, 40 + a[0].num_pages)), a[1])
    pool.load(1, 14, b[0], tuple(range(5, 5 + b[0].num_pages)), b[1])
    pool.set_tokens(np.array([14, 13, 0, 14]), set())
    assert pool.adapter_step_bytes == 2 * held_bytes(8, small) + 2 * held_bytes(16, large)
    assert pool.adapter_step_ranks == 8 + 16 + 8 + 16


def test_pages_of_other_blocks_keep_their_kv():
    pool, kv = make_pool()
    before = [t.clone() for t in kv]
    a = adapter(16, ("o_proj",), 2)
    pages = tuple(range(7, 7 + a[0].num_pages))
    pool.load(1, 5, a[0], pages, a[1])
    for layer in range(LAYERS):
        others = [i for i in range(KV_SHAPE[0]) if i not in pages]
        assert torch.equal(kv[layer][others], before[layer][others])
        assert not torch.equal(kv[layer][list(pages)], before[layer][list(pages)])
    assert pool.pages_of(5) == len(pages)


def test_a_scheduled_adapter_without_pages_is_an_error_not_a_silent_base_run():
    pool, _ = make_pool()
    with pytest.raises(RuntimeError, match=r"adapters \[9\] are scheduled but not resident"):
        pool.set_tokens(np.array([0, 9]), ignored_ids=set())
    pool.set_tokens(np.array([0, 9]), ignored_ids={9})
    assert pool.active and [b.num_blocks for b in pool._batches_for(2)] == [0]  # launch, no work


def test_evicted_slot_is_gone_and_reused():
    pool, _ = make_pool()
    a, b = adapter(8, ("q_proj",), 3), adapter(8, ("k_proj",), 4)
    pool.load(0, 1, a[0], tuple(range(1, 1 + a[0].num_pages)), a[1])
    pool.evict(0)
    with pytest.raises(RuntimeError, match="not resident"):
        pool.set_tokens(np.array([1]), set())
    pool.load(0, 2, b[0], tuple(range(1, 1 + b[0].num_pages)), b[1])
    assert pool.slot_of == {2: 0}


def test_page_view_refuses_a_layout_that_is_not_blocks_first():
    kv = torch.zeros(2, 40, 16, 16).transpose(0, 1)  # K/V-first storage
    with pytest.raises(ValueError, match="not blocks-first"):
        page_view(kv, 2 * 16 * 16)


@pytest.mark.parametrize("tuned", [False, True])
def test_warm_up_launches_every_variant_serving_launches(monkeypatch, tuned):
    """Issue 23: no kernel compiles while serving. The Triton backend's
    launches are recorded (not run): every (block height, tiles, split-K) a
    step of any token count up to the pool's maximum launches for each module
    kind was launched by the warm-up, which leaves pages, y and h as they were;
    with a tile table (`tuned`) too, whose tiles serving then launches."""
    from vllm_loraserve.kernels.tile_table import Tiles, TileTable
    from vllm_loraserve.kernels.triton_mbgmm import TritonBackend

    launched: list[tuple] = []

    class Recording(TritonBackend):
        def shrink(self, x, pool, h, batch, slots, module, layout, h_zeroed=False,
                   zero_next=None):  # neither changes the variant (no specialising)
            if batch.jobs is not None:  # the pool's path: the stream-K shrink
                launched.append(("stream", module, batch.block_m,
                                 self._tiles("stream", batch, module.in_features, module.count)))
            else:
                t, split_k, _ = self._shrink_launch(batch, slots.max_rank, module.in_features,
                                                    module.count, x.device)
                launched.append(("shrink", module, batch.block_m, t, split_k))
            assert int(batch.num_blocks_dev[0]) == 0  # no work: nothing computed

        def expand(self, h, pool, y, batch, slots, module, layout):
            launched.append(("expand", module, batch.block_m,
                             self._tiles("expand", batch, max(module.out_features),
                                         module.count)))

        def page_writer(self, pages):
            def write(page_ids, streams):
                launched.append(("write", tuple(page_ids.tolist())))
                TorchBackend().page_writer(pages)(page_ids, streams)
            return write

    from vllm_loraserve.kernels.reference import TorchBackend

    monkeypatch.setattr(pool_mod, "SMALL_BATCH", 512)  # inputs above it: two launches
    layout = model_layout(CFG, 1024)
    pool = DevicePool(layout.slices, LAYERS, max_rank=32, max_tokens=600, max_slots=128,
                      max_slices=3, backend="torch", device=torch.device("cpu"))
    # 128 slots: steps of up to ~110 tokens have at most 128 blocks (class
    # few), larger ones more (class short). The last entry fits no launch.
    table = TileTable("cpu", "any", {
        ("stream", "few", CFG.hidden_size, 3): Tiles(32, 128, num_stages=3),
        ("expand", "few", CFG.hidden_size, 1): Tiles(128, 32, num_warps=8),
        ("expand", "short", CFG.hidden_size, 1): Tiles(128, 64, num_warps=2),
        ("expand", "short", 12345, 1): Tiles(128, 64, num_warps=2)})
    pool.backend = Recording(table=table if tuned else None)
    kv = [torch.randn(KV_SHAPE) for _ in range(LAYERS)]
    before = [t.clone() for t in kv]
    pool.bind(kv)
    kinds = {ModuleSlices.of(layout, names) for names in
             (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
              ("down_proj",))}
    variants = pool.warm_up(kinds)
    assert pool.backend.table_keys_used == (set(list(table.entries)[:3]) if tuned else set())
    warmed = set(launched)
    assert ("write", (0,)) in warmed and all(torch.equal(a, b) for a, b in zip(kv, before,
                                                                          strict=True))
    shrinks = [k for k in launched if k[0] == "stream"]
    assert variants == 1 + len(shrinks) == 1 + len(set(shrinks))  # the writer; each once
    # Serving: every token count, through the pool's own path, as captured in
    # a CUDA graph (eager steps skip the launches of empty batches).
    monkeypatch.setattr(pool_mod, "capturing", lambda x: True)
    launched.clear()
    for num_tokens in range(1, 601):
        pool.set_tokens(np.zeros(num_tokens, dtype=np.int64), ignored_ids=set())
        pool.active = True  # as with adapter tokens: the launches depend on the count alone
        for ms in kinds:
            x = torch.zeros(num_tokens, ms.in_features)
            y = torch.zeros(num_tokens, sum(ms.out_features))
            pool.add_lora(0, ms, x, y)
    served = set(launched)
    assert {k[2] for k in served if k[0] == "stream"} == {16, 64}  # both block heights
    assert served <= warmed, served - warmed
    tiles = {k[-1] for k in served}
    tuned_tiles = {Tiles(32, 128, num_stages=3), Tiles(128, 32, num_warps=8),
                   Tiles(128, 64, num_warps=2)}
    assert (tuned_tiles <= tiles) if tuned else not tuned_tiles & tiles


def test_eager_steps_skip_empty_batchings_only():
    """Outside a graph capture, a batching without work blocks launches
    nothing; one with blocks launches shrink and expand."""
    pool, _ = make_pool()
    a = adapter(8, ("q_proj", "k_proj", "v_proj"), 3)
    pool.load(0, 1, a[0], tuple(range(1, 1 + a[0].num_pages)), a[1])
    calls = []

    class Counting:
        def shrink(self, *args, **kwargs):
            calls.append("shrink")

        def expand(self, *args):
            calls.append("expand")

    pool.backend = Counting()
    qkv = ModuleSlices.of(pool.layout, ("q_proj", "k_proj", "v_proj"))
    for ids, want in (([1, 0, 1], 2), ([0, 0, 0], 0)):
        calls.clear()
        pool.set_tokens(np.array(ids), ignored_ids=set())
        pool.active = True
        x = torch.zeros(3, qkv.in_features)
        pool.add_lora(0, qkv, x, torch.zeros(3, sum(qkv.out_features)))
        assert len(calls) == want, (ids, calls)


def test_a_step_fills_only_the_batches_its_layer_inputs_can_read(monkeypatch):
    """Each fill groups the tokens on the host, so a step fills the buffers
    of its own plan, plus those of the largest captured graph's plan when a
    graph may pad it. An eager input padded past them fills its own; a
    graph capture that would need one is an error, never a stale batch."""
    monkeypatch.setattr(pool_mod, "SMALL_BATCH", 4)
    pool, _ = make_pool()
    a = adapter(8, ("q_proj",), 5)
    pool.load(0, 1, a[0], tuple(range(1, 1 + a[0].num_pages)), a[1])
    large = set(pool_mod.LARGE_RULES[pool.large_rule])
    q = ModuleSlices.of(pool.layout, ("q_proj",))
    pool.set_tokens(np.ones(3, dtype=np.int64), ignored_ids=set())
    assert set(pool._batches) == {pool_mod.SMALL}
    with pytest.raises(RuntimeError, match="did not fill"):
        pool._batches_for(8, graph=True)
    # Eager, padded to 8 rows: the large batches are filled then, and hold
    # the step's 3 tokens (in 16- and 64-token blocks: 1 block each way).
    batches = pool._batches_for(8)
    assert set(pool._batches) == {pool_mod.SMALL} | large
    assert sorted(b.num_blocks for b in batches) == [0, 1]  # short: all 3; tall: none
    x, y = torch.randn(8, 64), torch.zeros(8, q.out_features[0])
    pool.add_lora(0, q, x, y)
    A, B = a[2][0]["q_proj"]
    want = 0.5 * (x[:3] @ A.T @ B.T)
    assert torch.allclose(y[:3], want, atol=1e-4) and not y[3:].any()
    pool.set_tokens(np.ones(6, dtype=np.int64), ignored_ids=set())
    assert set(pool._batches) == large
    # Once a graph of 8 rows is captured, a 3-token step may replay it.
    monkeypatch.setattr(pool_mod, "capturing", lambda x: True)
    pool.add_lora(0, q, torch.zeros(8, 64), torch.zeros(8, q.out_features[0]))
    pool.set_tokens(np.ones(3, dtype=np.int64), ignored_ids=set())
    assert set(pool._batches) == {pool_mod.SMALL} | large
    assert len(pool._batches_for(8, graph=True)) == len(large)
