"""Compiled Triton kernels (bf16, production tile sizes) against the torch
reference on a CUDA GPU (marker `gpu`; run through the device tool)."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_loraserve.kernels import get_backend, make_batch
from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer, write_pages

pytestmark = pytest.mark.gpu
SLICES = (SliceSpec("q_proj", 512, 512), SliceSpec("k_proj", 512, 128),
          SliceSpec("v_proj", 512, 128), SliceSpec("down_proj", 1408, 512))


def _scenario(rng, dev):
    """A pool of 8 adapters (ranks 1..128, partial targets) on shuffled pages."""
    layout = LayerLayout(SLICES, page_size=1024, align=256)  # rows straddle pages
    ranks = [1, 8, 16, 33, 64, 128, 8, 100]
    entries, total = [], 0
    placements = []
    for r in ranks:
        targets = [s.name for s in SLICES if rng.random() < 0.8] or ["down_proj"]
        w = {s.name: (torch.randn(r, s.in_features, device=dev) / 20,
                      torch.randn(s.out_features, r, device=dev) / 8)
             for s in SLICES if s.name in targets}
        placements.append((layout.place(r, targets), w))
        total += placements[-1][0].num_pages
    pool = torch.zeros(total + 3, layout.page_size, dtype=torch.bfloat16, device=dev)
    free = list(range(total + 3))
    rng.shuffle(free)
    for p, w in placements:
        ids = [free.pop() for _ in range(p.num_pages)]
        write_pages(pool, ids, pack_layer(layout, p, w, 0.5, torch.bfloat16), layout.page_size)
        entries.append((p, ids))
    return layout, pool, SlotTable.build(layout, entries, 128, dev), len(ranks)


def _mixed_step(rng, num_tokens, dev="cuda"):
    """A `_scenario` pool and a step of `num_tokens` tokens, each with a
    random adapter or none (-1)."""
    layout, pool, slots, n_adapters = _scenario(rng, dev)
    token_slots = [rng.choice([*range(n_adapters), -1]) for _ in range(num_tokens)]
    return layout, pool, slots, token_slots, make_batch(token_slots, dev)


# The module kinds the kernel tests run: a packed qkv, and down's wide input.
MODULE_NAMES = (["q_proj", "k_proj", "v_proj"], ["down_proj"])


def _defined(slots, token_slots, m, width, dev):
    """Where a shrink must write h ([slices, tokens, width]): each token with
    an adapter, slices its adapter targets, columns below its rank."""
    t = torch.tensor(token_slots, device=dev)
    s = t.clamp(min=0)
    rank = torch.where(t >= 0, slots.rank[s], 0)
    targeted = slots.seg_offsets[s][:, [2 * (m.first + i) for i in range(m.count)]].T >= 0
    cols = torch.arange(width, device=dev)
    return targeted[:, :, None] & (cols[None, None, :] < rank[None, :, None])


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300, 1500])
def test_triton_equals_reference_bf16(num_tokens):
    dev = "cuda"
    layout, pool, slots, token_slots, batch = _mixed_step(random.Random(num_tokens), num_tokens)
    triton_b, torch_b = get_backend("triton"), get_backend("torch")
    for names in MODULE_NAMES:
        m = ModuleSlices.of(layout, names)
        x = torch.randn(num_tokens, m.in_features, device=dev).to(torch.bfloat16)
        y0 = torch.randn(num_tokens, sum(m.out_features), device=dev).to(torch.bfloat16)
        h1, h2 = (torch.full((m.count, num_tokens, 128), float("nan"), device=dev)
                  for _ in range(2))
        triton_b.shrink(x, pool, h1, batch, slots, m, layout)
        torch_b.shrink(x, pool, h2, batch, slots, m, layout)
        defined = _defined(slots, token_slots, m, 128, dev)
        torch.testing.assert_close(h1[defined], h2[defined], atol=2e-2, rtol=2e-2)
        y1, y2 = y0.clone(), y0.clone()
        # Each expand reads its own shrink's h (the contract): the Triton one
        # past a rank only where its shrink zeroed h (split K), else the NaN
        # left there would show in y1; the reference never past a rank.
        h2[~defined] = float("nan")
        triton_b.expand(h1, pool, y1, batch, slots, m, layout)
        torch_b.expand(h2, pool, y2, batch, slots, m, layout)
        torch.testing.assert_close(y1.float(), y2.float(), atol=5e-2, rtol=2e-2)
        untouched = [t for t, s in enumerate(token_slots) if s < 0]
        assert torch.equal(y1[untouched], y0[untouched])


@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_backward_equals_reference_bf16(num_tokens):
    """The training kernels (kernels/__init__.py's expand_grad_h, shrink_grad_x,
    grad_pool) against the torch reference, each called twice: the first call
    is Triton's own launch, the second the plan's direct one (kernels/launch.py)."""
    dev = "cuda"
    layout, pool, slots, token_slots, batch = _mixed_step(random.Random(100 + num_tokens),
                                                          num_tokens)
    triton_b, torch_b = get_backend("triton"), get_backend("torch")
    for names in MODULE_NAMES:
        m = ModuleSlices.of(layout, names)
        x = torch.randn(num_tokens, m.in_features, device=dev).to(torch.bfloat16)
        dy = torch.randn(num_tokens, sum(m.out_features), device=dev).to(torch.bfloat16)
        h = torch.zeros(m.count, num_tokens, 128, device=dev)
        torch_b.shrink(x, pool, h, batch, slots, m, layout)
        defined = _defined(slots, token_slots, m, 128, dev)
        # Each kernel gets the reference's inputs, so an error of one kernel
        # is not carried into the next one's sums. The Triton kernels feed
        # tensor cores in the pool's dtype: the fp32 h and dh they read are
        # given already rounded to it, so the reference sums the same products.
        want_dh = torch.zeros_like(h)
        torch_b.expand_grad_h(dy, pool, want_dh, batch, slots, m, layout)
        dh_in, h_in = want_dh.to(pool.dtype).float(), h.to(pool.dtype).float()
        want_dx = torch.zeros_like(x)
        torch_b.shrink_grad_x(dh_in, pool, want_dx, batch, slots, m, layout)
        want_dpool = torch.zeros_like(pool, dtype=torch.float32)  # as the trainer's
        torch_b.grad_pool(x, h_in, dy, dh_in, want_dpool, batch, slots, m, layout)
        for _ in range(2):
            dh = torch.zeros_like(h)
            triton_b.expand_grad_h(dy, pool, dh, batch, slots, m, layout)
            torch.testing.assert_close(dh[defined], want_dh[defined], atol=2e-2, rtol=2e-2)
            dx = torch.zeros_like(x)
            triton_b.shrink_grad_x(dh_in, pool, dx, batch, slots, m, layout)
            torch.testing.assert_close(dx.float(), want_dx.float(), atol=5e-2, rtol=2e-2)
            dpool = torch.zeros_like(want_dpool)
            triton_b.grad_pool(x, h_in, dy, dh_in, dpool, batch, slots, m, layout)
            torch.testing.assert_close(dpool, want_dpool, atol=5e-2, rtol=2e-2)


def test_cuda_graph_replays_a_refilled_batch():
    """Capture shrink+expand once; refill the persistent metadata with another
    batch (fewer blocks) and replay: the result is that batch's."""
    from vllm_loraserve.kernels.batch import TokenBatchBuffers

    rng, dev = random.Random(3), "cuda"
    layout, pool, slots, n_adapters = _scenario(rng, dev)
    m = ModuleSlices.of(layout, ["q_proj", "k_proj", "v_proj"])
    buffers = TokenBatchBuffers(max_tokens=256, max_slots=n_adapters, block_m=16,
                                max_rank=slots.max_rank, device=dev)
    x = torch.randn(256, m.in_features, device=dev).to(torch.bfloat16)
    y = torch.zeros(256, sum(m.out_features), device=dev, dtype=torch.bfloat16)
    h = torch.empty(m.count, 256, 128, device=dev)
    triton_b, torch_b = get_backend("triton"), get_backend("torch")
    batch = buffers.fill([rng.randrange(n_adapters) for _ in range(256)], slots.rank)

    def step():
        y.zero_()
        triton_b.shrink(x, pool, h, batch, slots, m, layout)
        triton_b.expand(h, pool, y, batch, slots, m, layout)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    later = [rng.choice([0, 5, -1]) for _ in range(256)]  # 2 adapters: fewer blocks
    replayed = buffers.fill(later, slots.rank)
    assert replayed.num_blocks < batch.num_blocks
    graph.replay()
    torch.cuda.synchronize()
    want_h = torch.empty_like(h)
    want_y = torch.zeros_like(y)
    torch_b.shrink(x, pool, want_h, replayed, slots, m, layout)
    torch_b.expand(want_h, pool, want_y, replayed, slots, m, layout)
    torch.testing.assert_close(y.float(), want_y.float(), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("streams_dtype", [torch.bfloat16, torch.float32])
def test_page_writer_equals_the_torch_writer(streams_dtype):
    """One launch for every layer's pages of a load (the pool's GPU path)
    writes what the torch backend (one index_copy_ per layer) writes, bit for bit, downcasts
    included; other pages keep their contents."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    kv = [torch.randn(64, 131072, generator=g, device=dev).to(torch.bfloat16) for _ in range(4)]
    ids = torch.randperm(64, device=dev)[:12].int()
    streams = torch.randn(4, 12 * 131072, generator=g, device=dev).to(streams_dtype)
    out = {}
    for name in ("torch", "triton"):
        pages = [t.clone() for t in kv]
        get_backend(name).page_writer(pages)(ids, streams)
        torch.cuda.synchronize()
        out[name] = pages
    for layer in range(4):
        assert torch.equal(out["triton"][layer], out["torch"][layer])
        assert not torch.equal(out["triton"][layer], kv[layer])


def test_direct_launch_equals_tritons_own_and_keys_alignment():
    """After its first launch, the module path launches the compiled variant
    directly (kernels/launch.py). Those launches give Triton's own result bit
    for bit; a y that is not 16-byte aligned, which Triton compiles another
    variant for, gets its own entry, and its result is still right."""
    from vllm_loraserve.kernels.batch import TokenBatchBuffers
    from vllm_loraserve.kernels.triton_mbgmm import TritonBackend

    rng, dev = random.Random(5), "cuda"
    layout, pool, slots, n_adapters = _scenario(rng, dev)
    m = ModuleSlices.of(layout, ["q_proj", "k_proj", "v_proj"])
    width = sum(m.out_features)
    buffers = TokenBatchBuffers(max_tokens=64, max_slots=n_adapters, block_m=16,
                                max_rank=slots.max_rank, device=dev)
    batch = buffers.fill([rng.randrange(n_adapters) for _ in range(40)], slots.rank)
    backend = TritonBackend()
    x = torch.randn(40, m.in_features, device=dev).to(torch.bfloat16)
    y0 = torch.randn(40, width, device=dev).to(torch.bfloat16)
    h = torch.empty(m.count, 40, 128, device=dev)
    backend.shrink(x, pool, h, batch, slots, m, layout)
    outs = []
    for _ in range(3):
        y = y0.clone()
        backend.expand(h, pool, y, batch, slots, m, layout)
        outs.append(y)
    (launch,) = [plan[1] for key, plan in backend._plans.items() if key[0] == "expand"]
    assert len(launch._compiled) == 1
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    want = y0.clone()
    get_backend("torch").expand(h, pool, want, batch, slots, m, layout)
    torch.testing.assert_close(outs[0].float(), want.float(), atol=5e-2, rtol=2e-2)
    for _ in range(2):
        odd = torch.empty(40 * width + 1, device=dev, dtype=torch.bfloat16)[1:].view(40, width)
        assert odd.data_ptr() % 16
        odd.copy_(y0)
        backend.expand(h, pool, odd, batch, slots, m, layout)
        assert torch.equal(odd, outs[0])
    assert len(launch._compiled) == 2
