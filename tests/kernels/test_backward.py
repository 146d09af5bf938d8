"""The kernels' backward ops (input and weight gradients over paged weights,
Triton interpreted on CPU and the torch reference) against autograd through
dense math on the same weights: mixed ranks, tokens without adapters,
partial adapters, slots spanning several work blocks."""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_mbgmm import MAX_RANK, MODULES, Scenario, small_tiles
from vllm_loraserve.kernels import get_backend, make_batch
from vllm_loraserve.kernels.batch import ModuleSlices
from vllm_loraserve.kernels.triton_mbgmm import GradTiles, TritonBackend
from vllm_loraserve.paging.layout import add_to_segment, read_segment


def backends():
    small_grad = lambda batch: GradTiles(block_m=16, block_r=16, block_n=16)  # noqa: E731
    return [pytest.param(get_backend("torch"), id="torch"),
            pytest.param(TritonBackend(*small_tiles(1), grad_tiles=small_grad), id="triton"),
            pytest.param(TritonBackend(*small_tiles(3, expand_k=MAX_RANK),
                                       grad_tiles=small_grad),
                         id="triton-split3")]


def _dense_grads(sc, x, dy, token_slots, names):
    """dx and, per (slot, slice), (dA, dBt) by autograd through dense math."""
    module = ModuleSlices.of(sc.layout, names)
    x = x.float().clone().requires_grad_(True)
    leaves = {(slot, n): (a.clone().requires_grad_(True), bt.clone().requires_grad_(True))
              for slot, w in sc.dense.items() for n, (a, bt) in w.items() if n in names}
    rows = []
    for t, slot in enumerate(token_slots):
        parts = []
        for s, name in enumerate(names):
            width = module.out_features[s]
            if slot >= 0 and (slot, name) in leaves:
                a, bt = leaves[slot, name]
                parts.append((x[t] @ a.T) @ bt)
            else:
                parts.append(torch.zeros(width))
        rows.append(torch.cat(parts))
    (torch.stack(rows) * dy.float()).sum().backward()
    zero = torch.zeros_like
    return x.grad, {k: (zero(a) if a.grad is None else a.grad,
                        zero(bt) if bt.grad is None else bt.grad)
                    for k, (a, bt) in leaves.items()}


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed, num_tokens, block_m", [(0, 1, 16), (2, 37, 16), (3, 40, 32)])
def test_backward_matches_autograd(backend, dtype, seed, num_tokens, block_m):
    sc = Scenario(seed, dtype)
    rng = random.Random(seed + 100)
    token_slots = sc.token_slots(rng, num_tokens)
    batch = make_batch(token_slots, block_m=block_m)
    g = torch.Generator().manual_seed(seed)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for names in MODULES.values():
        module = ModuleSlices.of(sc.layout, names)
        x = torch.randn(num_tokens, module.in_features, generator=g).to(dtype)
        dy = torch.randn(num_tokens, sum(module.out_features), generator=g).to(dtype)
        want_dx, want_w = _dense_grads(sc, x, dy, token_slots, names)

        h = torch.zeros(len(names), num_tokens, MAX_RANK)
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        dh = torch.full_like(h, 5.0)
        backend.expand_grad_h(dy, sc.pool, dh, batch, sc.slots, module, sc.layout)
        dx = torch.zeros_like(x)
        backend.shrink_grad_x(dh, sc.pool, dx, batch, sc.slots, module, sc.layout)
        torch.testing.assert_close(dx.float(), want_dx, **tol)

        dpool = torch.zeros_like(sc.pool)
        backend.grad_pool(x, h, dy, dh, dpool, batch, sc.slots, module, sc.layout)
        pages2d = dpool.view(-1, sc.layout.page_size)
        for (slot, name), (da, dbt) in want_w.items():
            gi = sc.layout.slice_index(name)
            rank, offs = int(sc.slots.rank[slot]), sc.slots.seg_offsets[slot].tolist()
            got = [read_segment(sc.layout, pages2d, sc.slots.pages[slot], rank, offs[seg], seg)
                   for seg in (2 * gi, 2 * gi + 1)]
            torch.testing.assert_close(got[0].float(), da, **tol)
            torch.testing.assert_close(got[1].float(), dbt, **tol)
        # Nothing outside the adapters' segments is written (padding, free pages).
        touched = torch.zeros_like(pages2d, dtype=torch.bool)
        for (slot, name) in want_w:
            gi = sc.layout.slice_index(name)
            rank, offs = int(sc.slots.rank[slot]), sc.slots.seg_offsets[slot].tolist()
            for seg in (2 * gi, 2 * gi + 1):
                marker = torch.zeros_like(pages2d, dtype=torch.float32)
                cols = sc.layout.slices[gi].out_features if seg % 2 else \
                    sc.layout.slices[gi].in_features
                add_to_segment(sc.layout, marker, sc.slots.pages[slot], offs[seg], seg,
                               torch.ones(rank, cols))
                touched |= marker > 0
        assert torch.all(pages2d[~touched] == 0)


def test_tokens_without_adapter_get_no_gradient():
    sc = Scenario(4, torch.float32)
    module = ModuleSlices.of(sc.layout, MODULES["qkv"])
    slot = sc.used_slots[0]
    batch = make_batch([slot, -1, slot])
    backend = get_backend("torch")
    x, dy = torch.randn(3, module.in_features), torch.randn(3, sum(module.out_features))
    h, dh = torch.zeros(3, 3, MAX_RANK), torch.zeros(3, 3, MAX_RANK)
    backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
    backend.expand_grad_h(dy, sc.pool, dh, batch, sc.slots, module, sc.layout)
    dx = torch.zeros_like(x)
    backend.shrink_grad_x(dh, sc.pool, dx, batch, sc.slots, module, sc.layout)
    assert torch.all(dh[:, 1] == 0) and torch.all(dx[1] == 0) and torch.any(dx[0] != 0)
