"""The device pool on the Triton kernels (interpreted on CPU): persistent
buffers, grids bounded by the layer's token count, both work-block heights,
against the torch backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.worker.test_pool import CFG, KV_SHAPE, LAYERS, adapter
from vllm_loraserve.kernels import get_backend
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.paging.model import model_layout
from vllm_loraserve.worker import pool as pool_mod
from vllm_loraserve.worker.pool import DevicePool


def build(backend, kv):
    layout = model_layout(CFG, 1024)
    p = DevicePool(layout.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                   max_slices=3, backend=backend, device=torch.device("cpu"))
    p.bind(kv)
    return p


def torch_and_triton_pools():
    """A torch and a Triton pool holding the same two adapters (ids 11 and
    12, every module kind between them), and the module kinds in layer order."""
    a = adapter(8, ("q_proj", "k_proj", "v_proj", "down_proj"), 0)
    b = adapter(16, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"), 1)
    b_first = 1 + a[0].num_pages
    pools = []
    for backend in ("torch", "triton"):
        kv = [torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(9))
              for _ in range(LAYERS)]
        p = build(backend, kv)
        p.load(3, 11, a[0], tuple(range(1, b_first)), a[1])
        p.load(0, 12, b[0], tuple(range(b_first, b_first + b[0].num_pages)), b[1])
        pools.append(p)
    modules = sorted({ModuleSlices.of(pools[1].layout, names) for names in (
        ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
        ("down_proj",))}, key=lambda m: m.first)
    return pools[0], pools[1], modules


@pytest.mark.parametrize("small_batch", [64, 4])  # 16- and 64-token work blocks
def test_triton_pool_matches_torch_pool(monkeypatch, small_batch):
    monkeypatch.setattr(pool_mod, "SMALL_BATCH", small_batch)
    a = adapter(8, ("q_proj", "k_proj", "v_proj", "down_proj"), 0)
    b = adapter(32, ("q_proj", "v_proj", "o_proj"), 1)
    pools = []
    for backend in ("torch", "triton"):
        kv = [torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(9))
              for _ in range(LAYERS)]
        p = build(backend, kv)
        p.load(3, 11, a[0], tuple(range(5, 5 + a[0].num_pages)), a[1])
        p.load(0, 12, b[0], tuple(range(20, 20 + b[0].num_pages)), b[1])
        pools.append(p)
    rng = np.random.default_rng(0)
    for step in range(2):  # a second, smaller batch refills the same buffers
        tokens = rng.choice([0, 11, 12], size=20 if step == 0 else 7)
        x = torch.randn(len(tokens) + 3, 64)  # 3 rows of graph padding: no adapter
        y0 = torch.randn(len(tokens) + 3, 64 + 2 * 32)
        outs = []
        for p in pools:
            p.set_tokens(tokens, ignored_ids=set())
            qkv = ModuleSlices.of(p.layout, ("q_proj", "k_proj", "v_proj"))
            y = y0.clone()
            p.add_lora(1, qkv, x, y)
            outs.append(y)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(outs[1][len(tokens):], y0[len(tokens):])
        assert not torch.equal(outs[1], y0)


@pytest.mark.parametrize("dtype,streams_dtype,page_size", [
    (torch.float32, torch.float32, 1024), (torch.bfloat16, torch.bfloat16, 4608),
    (torch.float32, torch.bfloat16, 1024)])  # an exact upcast on write
def test_page_writers_write_every_layers_pages_and_nothing_else(dtype, streams_dtype,
                                                                page_size):
    """A load's pages, all layers at once: the Triton writer (one launch, a
    table of layer addresses) and the torch one give the same pools, with
    pages outside `ids` untouched. 4608 elements: a page is two programs'
    chunks, the second one partial. (No downcast here: Triton's interpreter
    truncates to bf16 where the GPU rounds to nearest.)"""
    layers, blocks, ids = 3, 12, torch.tensor([7, 2, 9], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(blocks, page_size, generator=g).to(dtype) for _ in range(layers)]
    streams = torch.randn(layers, len(ids) * page_size, generator=g).to(streams_dtype)
    for name in ("torch", "triton"):
        pages = [t.clone() for t in kv]
        get_backend(name).page_writer(pages)(ids, streams)
        for layer in range(layers):
            expected = kv[layer].clone()
            expected[ids.long()] = streams[layer].view(len(ids), page_size).to(dtype)
            assert torch.equal(pages[layer], expected), (name, layer)


def test_triton_page_writer_refuses_streams_of_another_shape():
    pages = [torch.zeros(4, 1024) for _ in range(2)]
    write = get_backend("triton").page_writer(pages)
    with pytest.raises(ValueError, match="do not hold 2 pages"):
        write(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 1024))


@pytest.mark.parametrize("rule", sorted(pool_mod.LARGE_RULES))
def test_large_batch_rules_match_torch_pool(monkeypatch, rule):
    """Above SMALL_BATCH rows, every rule gives the torch pool's result. The
    step holds a prefill chunk of one adapter (20 tokens >= TALL, lowered to
    16: 64-token blocks under "split") and a few decode tokens of another
    (16-token blocks), interleaved, plus padding rows without an adapter."""
    monkeypatch.setattr(pool_mod, "SMALL_BATCH", 4)
    monkeypatch.setattr(pool_mod, "TALL", 16)
    a = adapter(8, ("q_proj", "k_proj", "v_proj", "down_proj"), 0)
    b = adapter(32, ("q_proj", "v_proj", "o_proj"), 1)
    tokens = np.array([12] * 10 + [11, 0, 11] + [12] * 10 + [11])
    assert (tokens == 12).sum() >= pool_mod.TALL > (tokens == 11).sum()
    x = torch.randn(len(tokens) + 3, 64, generator=torch.Generator().manual_seed(2))
    y0 = torch.randn(len(tokens) + 3, 64 + 2 * 32, generator=torch.Generator().manual_seed(3))
    outs = []
    for backend in ("torch", "triton"):
        kv = [torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(9))
              for _ in range(LAYERS)]
        layout = model_layout(CFG, 1024)
        p = DevicePool(layout.slices, LAYERS, max_rank=32, max_tokens=64, max_slots=8,
                       max_slices=3, backend=backend, device=torch.device("cpu"),
                       large_rule=rule if backend == "triton" else "all64")
        p.bind(kv)
        p.load(3, 11, a[0], tuple(range(5, 5 + a[0].num_pages)), a[1])
        p.load(0, 12, b[0], tuple(range(20, 20 + b[0].num_pages)), b[1])
        p.set_tokens(tokens, ignored_ids=set())
        assert len(p._batches_for(len(x))) == len(pool_mod.LARGE_RULES[p.large_rule])
        y = y0.clone()
        p.add_lora(1, ModuleSlices.of(p.layout, ("q_proj", "k_proj", "v_proj")), x, y)
        outs.append(y)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[1][len(tokens):], y0[len(tokens):])
    assert torch.equal(outs[1][11], y0[11])  # the token without an adapter


def test_split_token_sets_partition_the_adapter_tokens(monkeypatch):
    """"short" and "tall" are disjoint and together hold exactly the tokens
    with an adapter; an adapter is tall from TALL tokens on, and only if the
    tall adapters hold more than SMALL_BATCH tokens together."""
    monkeypatch.setattr(pool_mod, "TALL", 4)
    slots = np.array([2] * 4 + [5] * 3 + [-1, 7, -1, 8, 8, 8, 8, 8])
    for small_batch, want_tall in ((8, {2, 8}), (9, set())):
        monkeypatch.setattr(pool_mod, "SMALL_BATCH", small_batch)
        sets = DevicePool._token_sets(slots)
        short, tall = sets["short"], sets["tall"]
        assert ((short >= 0) & (tall >= 0)).sum() == 0
        assert np.array_equal(np.maximum(short, tall), slots)
        assert set(tall[tall >= 0].tolist()) == want_tall
        assert set(short[short >= 0].tolist()) == {2, 5, 7, 8} - want_tall


def test_unknown_large_rule_is_refused():
    with pytest.raises(ValueError, match="unknown large-batch rule"):
        DevicePool(model_layout(CFG, 1024).slices, LAYERS, 32, 64, 8, 3, "torch",
                   torch.device("cpu"), large_rule="all32")


@pytest.mark.parametrize("small_batch", [64, 4])  # 4: two batchings (shrinks) a module
def test_a_forward_zeroes_h_once_and_trusts_nothing_from_another(monkeypatch, small_batch):
    """Each stream-K shrink zeroes the other h buffer for the next one, so
    only a forward's first shrink zeroes its own h. Both buffers start as
    NaN, and are set to NaN again between forwards (as a CUDA graph's
    replay, which the host does not see, may leave them): a shrink trusting
    a zeroing it should not, or a missed one, puts NaN into y. The second
    forward has more tokens than the first; the third runs the second's step
    again without `set_tokens` (as vLLM's warm-up and graph capture do): its
    start is found from the layer order alone."""
    monkeypatch.setattr(pool_mod, "SMALL_BATCH", small_batch)
    monkeypatch.setattr(pool_mod, "TALL", 8)
    torch_pool, triton_pool, modules = torch_and_triton_pools()
    told = []
    shrink = triton_pool.backend.shrink
    monkeypatch.setattr(triton_pool.backend, "shrink",
                        lambda *args, **kw: (told.append(kw["h_zeroed"]), shrink(*args, **kw)))
    rng = np.random.default_rng(1)
    small, large = (rng.choice([0, 11, 12], size=n, p=(0.2, 0.1, 0.7)) for n in (9, 30))
    for tokens, new_step in ((small, True), (large, True), (large, False)):
        n = len(tokens)
        triton_pool._h.fill_(float("nan"))
        told.clear()
        if new_step:
            for p in (torch_pool, triton_pool):
                p.set_tokens(tokens, ignored_ids=set())
        for layer in range(LAYERS):
            for m in modules:
                x = torch.randn(n + 2, m.in_features)
                y0 = torch.randn(n + 2, sum(m.out_features))
                want, got = y0.clone(), y0.clone()
                torch_pool.add_lora(layer, m, x, want)
                triton_pool.add_lora(layer, m, x, got)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # With 30 tokens and SMALL_BATCH 4, adapter 12's are a tall batching
        # of their own: two shrinks a module.
        shrinks = LAYERS * len(modules) * (2 if small_batch == 4 and n == 30 else 1)
        assert told == [False] + [True] * (shrinks - 1)
