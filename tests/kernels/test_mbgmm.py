"""The paged LoRA kernels (Triton, interpreted on CPU) and the torch reference
against dense math on the original weights: random mixes of ranks (1..64),
token counts, tokens without adapters, partial adapters, empty slots,
shuffled page orders and rows straddling pages."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_loraserve.kernels import get_backend, make_batch
from vllm_loraserve.kernels.batch import JOB_ROWS, ModuleSlices, SlotTable
from vllm_loraserve.kernels.triton_mbgmm import Tiles, TritonBackend
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layer, write_pages

HIDDEN, KV, INTER = 64, 32, 96
SLICES = (SliceSpec("q_proj", HIDDEN, HIDDEN), SliceSpec("k_proj", HIDDEN, KV),
          SliceSpec("v_proj", HIDDEN, KV), SliceSpec("o_proj", HIDDEN, HIDDEN),
          SliceSpec("gate_proj", HIDDEN, INTER), SliceSpec("up_proj", HIDDEN, INTER),
          SliceSpec("down_proj", INTER, HIDDEN))
MODULES = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"],
           "gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"]}
MAX_RANK = 64


def small_tiles(split_k, shrink_n=16, expand_k=16):
    """The test layout has align 16: the tiles' page chunks (shrink block_k,
    expand block_n) must divide it. shrink_n >= MAX_RANK: all rank rows in
    one tile; expand_k >= MAX_RANK: all rank rows in one step (h read once
    per block)."""
    return (lambda batch, k: Tiles(block_n=shrink_n, block_k=16, split_k=split_k),
            lambda batch, n: Tiles(block_n=16, block_k=expand_k))


def stream_tiles(batch, k):
    """The stream shrink's tiles for this layout (align 16)."""
    return Tiles(block_n=JOB_ROWS, block_k=16)


def backends():
    out = [pytest.param(get_backend("torch"), id="torch")]
    for split_k, shrink_n, expand_k in ((1, 16, 16), (3, 16, MAX_RANK),
                                        (0, MAX_RANK, 16)):  # split 0: automatic
        out.append(pytest.param(TritonBackend(*small_tiles(split_k, shrink_n, expand_k)),
                                id=f"triton-split{split_k}-n{shrink_n}-k{expand_k}"))
    return out


class Scenario:
    """A pool with several adapters on shuffled pages and their dense weights."""

    def __init__(self, seed, dtype, num_slots=5):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.layout = LayerLayout(SLICES, page_size=48, align=16)  # rows straddle pages
        self.dtype = dtype
        entries, self.dense = [], {}
        placements = []
        for slot in range(num_slots):
            if slot == 2:  # an empty slot between used ones
                entries.append(None)
                continue
            rank = rng.choice([1, 3, 8, 16, 17, 33, 64])
            targets = [s.name for s in SLICES if rng.random() < 0.8] or ["q_proj"]
            weights = {t: (torch.randn(rank, self._spec(t).in_features, generator=g) * 0.3,
                           torch.randn(self._spec(t).out_features, rank, generator=g) * 0.3)
                       for t in targets}
            scaling = rng.choice([0.5, 2.0])
            placement = self.layout.place(rank, targets)
            placements.append((slot, placement, weights, scaling))
            self.dense[slot] = {t: (a.to(dtype).float(), (b.T * scaling).to(dtype).float())
                                for t, (a, b) in weights.items()}
        total = sum(p.num_pages for _, p, _, _ in placements) + 5
        self.pool = torch.full((total, self.layout.page_size), 7.0, dtype=dtype)
        free = list(range(total))
        rng.shuffle(free)
        slot_entries = dict.fromkeys(range(num_slots))
        for slot, placement, weights, scaling in placements:
            ids = [free.pop() for _ in range(placement.num_pages)]
            write_pages(self.pool, ids, pack_layer(self.layout, placement, weights, scaling,
                                                   dtype), self.layout.page_size)
            slot_entries[slot] = (placement, ids)
        self.slots = SlotTable.build(self.layout, [slot_entries[i] for i in range(num_slots)],
                                     MAX_RANK)
        self.used_slots = sorted(self.dense)

    def _spec(self, name):
        return next(s for s in SLICES if s.name == name)

    def token_slots(self, rng, n):
        return [rng.choice(self.used_slots + [-1]) for _ in range(n)]


def _dense_expected(sc, x, token_slots, names, y0):
    """h [n, T, MAX_RANK] (NaN where a shrink need not write: past each
    token's rank, untargeted slices, tokens without an adapter) and y from
    dense math."""
    module = ModuleSlices.of(sc.layout, names)
    h = torch.full((len(names), x.shape[0], MAX_RANK), float("nan"))
    y = y0.float().clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for s, name in enumerate(names):
            if name not in sc.dense[slot]:
                continue
            a, bt = sc.dense[slot][name]
            h[s, t, :a.shape[0]] = x[t].float() @ a.T
            col = module.out_offsets[s]
            y[t, col:col + bt.shape[1]] += h[s, t, :a.shape[0]] @ bt
    return h, y


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed, num_tokens, block_m", [(0, 1, 16), (1, 9, 16), (2, 37, 16),
                                                       (3, 40, 32)])
def test_kernels_match_dense_math(backend, dtype, seed, num_tokens, block_m):
    sc = Scenario(seed, dtype)
    rng = random.Random(seed + 100)
    token_slots = sc.token_slots(rng, num_tokens)
    batch = make_batch(token_slots, block_m=block_m)
    g = torch.Generator().manual_seed(seed)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for names in MODULES.values():
        module = ModuleSlices.of(sc.layout, names)
        x = torch.randn(num_tokens, module.in_features, generator=g).to(dtype)
        y0 = torch.randn(num_tokens, sum(module.out_features), generator=g).to(dtype)
        want_h, want_y = _dense_expected(sc, x, token_slots, names, y0)
        # NaN past each rank, unless the shrink zeroed h (split K): any read
        # of it would show in y.
        h = torch.full((len(names), num_tokens, MAX_RANK), float("nan"))
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        defined = ~want_h.isnan()
        torch.testing.assert_close(h[defined], want_h[defined], **tol)
        y = y0.clone()
        backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
        torch.testing.assert_close(y.float(), want_y, **tol)
        no_adapter = [t for t, s in enumerate(token_slots) if s < 0]
        assert torch.equal(y[no_adapter], y0[no_adapter])  # bit-for-bit untouched


@pytest.mark.parametrize("expand_k", [16, MAX_RANK])
@pytest.mark.parametrize("seed, num_tokens, block_m", [(7, 1, 16), (7, 9, 16), (8, 37, 16),
                                                       (9, 40, 32)])
def test_stream_shrink_over_jobs_matches_dense_math(expand_k, seed, num_tokens, block_m):
    """With the slots' ranks given, the batch has jobs and the shrink is the
    stream-K kernel: programs take equal runs of (job, slice, BK columns)
    units, so pieces split across programs add into h. The same h and y as
    dense math (the expand reads the zeroed h unmasked)."""
    sc = Scenario(seed, torch.float32)
    rng = random.Random(seed + 100)
    token_slots = sc.token_slots(rng, num_tokens)
    batch = make_batch(token_slots, block_m=block_m, ranks=sc.slots.rank)
    assert batch.jobs is not None
    backend = TritonBackend(*small_tiles(1, expand_k=expand_k), stream_tiles=stream_tiles)
    g = torch.Generator().manual_seed(seed)
    for names in MODULES.values():
        module = ModuleSlices.of(sc.layout, names)
        x = torch.randn(num_tokens, module.in_features, generator=g)
        y0 = torch.randn(num_tokens, sum(module.out_features), generator=g)
        want_h, want_y = _dense_expected(sc, x, token_slots, names, y0)
        h = torch.full((len(names), num_tokens, MAX_RANK), float("nan"))
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        defined = ~want_h.isnan()
        torch.testing.assert_close(h[defined], want_h[defined], atol=1e-4, rtol=1e-4)
        y = y0.clone()
        backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
        no_adapter = [t for t, s in enumerate(token_slots) if s < 0]
        assert torch.equal(y[no_adapter], y0[no_adapter])


def test_stream_tiles_must_be_job_rows_high():
    sc = Scenario(0, torch.float32)
    batch = make_batch([sc.used_slots[0]] * 3, ranks=sc.slots.rank)
    module = ModuleSlices.of(sc.layout, MODULES["o"])
    backend = TritonBackend(*small_tiles(1),
                            stream_tiles=lambda b, k: Tiles(block_n=16, block_k=16))
    with pytest.raises(ValueError, match="rank rows for jobs"):
        backend.shrink(torch.randn(3, HIDDEN), sc.pool, torch.zeros(1, 3, MAX_RANK), batch,
                       sc.slots, module, sc.layout)


@pytest.mark.parametrize("split_k, expand_k", [(1, 16), (3, MAX_RANK)])
def test_h_wider_than_the_max_rank(split_k, expand_k):
    """An h wider than the table's max rank (its extra columns NaN): the
    shrink writes the same first MAX_RANK columns, and the expand reads
    nothing past each rank."""
    sc = Scenario(6, torch.float32)
    rng = random.Random(6)
    token_slots = sc.token_slots(rng, 21)
    batch = make_batch(token_slots)
    backend = TritonBackend(*small_tiles(split_k, expand_k=expand_k))
    for names in MODULES.values():
        module = ModuleSlices.of(sc.layout, names)
        x = torch.randn(21, module.in_features)
        y0 = torch.randn(21, sum(module.out_features))
        want_h, want_y = _dense_expected(sc, x, token_slots, names, y0)
        h = torch.full((len(names), 21, MAX_RANK + 8), float("nan"))
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        defined = ~want_h.isnan()
        torch.testing.assert_close(h[..., :MAX_RANK][defined], want_h[defined],
                                   atol=1e-4, rtol=1e-4)
        y = y0.clone()
        backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", backends())
def test_batch_without_adapters_is_a_no_op(backend):
    sc = Scenario(5, torch.float32)
    module = ModuleSlices.of(sc.layout, MODULES["qkv"])
    batch = make_batch([-1, -1, -1])
    x, y = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN + 2 * KV)
    h = torch.full((3, 3, MAX_RANK), 1.0)
    backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
    y0 = y.clone()
    backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
    assert torch.equal(y, y0)


def test_a_wrong_page_is_detected():
    """The comparison is sensitive to the gather: swapping two of an adapter's
    pages changes the result."""
    sc = Scenario(0, torch.float32)
    slot = next(s for s in sc.used_slots if int(sc.slots.rank[s]) >= 8)
    token_slots = [slot] * 4
    module = ModuleSlices.of(sc.layout, MODULES["qkv"])
    x = torch.randn(4, HIDDEN)
    want, _ = _dense_expected(sc, x, token_slots, MODULES["qkv"],
                              torch.zeros(4, HIDDEN + 2 * KV))
    pages = sc.slots.pages.clone()
    pages[slot, [0, 1]] = pages[slot, [1, 0]]
    swapped = SlotTable(sc.slots.rank, sc.slots.seg_offsets, pages, MAX_RANK)
    h = torch.zeros(3, 4, MAX_RANK)
    get_backend("triton").__class__(*small_tiles(1)).shrink(
        x, sc.pool, h, make_batch(token_slots), swapped, module, sc.layout)
    assert not torch.allclose(h, want, atol=1e-3)


def test_column_tiles_must_fit_the_panel():
    """A tile that crosses a panel, or that does not start runs at multiples
    of 16 (what the kernels tell Triton), is refused before any launch."""
    sc = Scenario(0, torch.float32)
    module = ModuleSlices.of(sc.layout, MODULES["o"])
    x, h = torch.randn(2, HIDDEN), torch.zeros(1, 2, MAX_RANK)
    with pytest.raises(ValueError, match="column tile 128 must be a multiple of 16 that divides "
                                         "the layout's panel 16"):
        TritonBackend().shrink(x, sc.pool, h, make_batch([0, 0]), sc.slots, module, sc.layout)
    eights = TritonBackend(expand_tiles=lambda batch, n: Tiles(block_n=8, block_k=16))
    with pytest.raises(ValueError, match="column tile 8 must be a multiple of 16"):
        eights.expand(h, sc.pool, torch.zeros(2, HIDDEN), make_batch([0, 0]), sc.slots, module,
                      sc.layout)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown LoRA kernel backend 'cuda'"):
        get_backend("cuda")


def test_token_batch_groups_by_slot():
    b = make_batch([3, -1, 0, 3, 0, 3, 3], block_m=2)
    assert b.sorted_tokens.tolist() == [2, 4, 0, 3, 5, 6]
    assert b.blocks.tolist() == [[0, 0, 2], [3, 2, 2], [3, 4, 2]]
    assert b.num_blocks == b.max_blocks == 3 and b.num_blocks_dev.tolist() == [3]
    assert make_batch([0] * 40).block_m == 64 and make_batch(list(range(8))).block_m == 16


@pytest.mark.parametrize("backend", [
    pytest.param(get_backend("torch"), id="torch"),
    *(pytest.param(TritonBackend(*small_tiles(1, expand_k=expand_k),
                                 stream_tiles=stream_tiles), id=f"triton-k{expand_k}")
      for expand_k in (16, MAX_RANK))])
def test_persistent_buffers_refilled_with_a_smaller_batch(backend):
    """What CUDA-graph replay relies on: the same buffers and grid, refilled
    with a batch of fewer blocks, give that batch's result; the stale blocks
    left behind the new count are ignored."""
    from vllm_loraserve.kernels.batch import TokenBatchBuffers

    sc = Scenario(4, torch.float32)
    buffers = TokenBatchBuffers(max_tokens=40, max_slots=5, block_m=16, max_rank=MAX_RANK)
    names = MODULES["qkv"]
    module = ModuleSlices.of(sc.layout, names)
    rng = random.Random(9)
    first = buffers.fill(sc.token_slots(rng, 40), sc.slots.rank)
    for n in (40, 9):
        token_slots = sc.token_slots(rng, n)
        batch = buffers.fill(token_slots, sc.slots.rank)
        assert batch.max_blocks == first.max_blocks and batch.blocks is first.blocks
        assert batch.max_jobs == first.max_jobs and batch.jobs is first.jobs
        x = torch.randn(n, HIDDEN)
        y0 = torch.randn(n, HIDDEN + 2 * KV)
        want_h, want_y = _dense_expected(sc, x, token_slots, names, y0)
        h = torch.zeros(len(names), n, MAX_RANK)
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        y = y0.clone()
        backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
        defined = ~want_h.isnan()
        torch.testing.assert_close(h[defined], want_h[defined], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="buffer capacity 40"):
        buffers.fill([0] * 41, sc.slots.rank)


def test_a_tile_table_replaces_the_rules_where_it_has_an_entry():
    """--loraserve-tiles: the table's tiles launch for the keys it holds
    (qkv's expand, o's shrink), the rules' for every other (qkv's shrink: the
    same K as o's, another slice count; down's shrink: o's slice count,
    another K), and every module still gives dense math."""
    from vllm_loraserve.kernels.tile_table import TileTable, batch_class

    sc = Scenario(3, torch.float32)
    rng = random.Random(3)
    token_slots = sc.token_slots(rng, 21)
    batch = make_batch(token_slots, ranks=sc.slots.rank)
    cls = batch_class(batch.max_blocks, batch.block_m)
    table = TileTable("cpu", "any", {
        ("stream", cls, HIDDEN, 1): Tiles(JOB_ROWS, 16, num_stages=1, programs_per_sm=16),
        ("expand", cls, HIDDEN, 3): Tiles(16, MAX_RANK, num_warps=2, programs_per_sm=1)})
    backend = TritonBackend(*small_tiles(1), stream_tiles=stream_tiles, table=table)
    g = torch.Generator().manual_seed(3)
    for name, stages, expand_k, warps in (("qkv", 2, MAX_RANK, 2), ("o", 1, 16, 4),
                                          ("down", 2, 16, 4), ("gate_up", 2, 16, 4)):
        module = ModuleSlices.of(sc.layout, MODULES[name])
        x = torch.randn(21, module.in_features, generator=g)
        y0 = torch.randn(21, sum(module.out_features), generator=g)
        want_h, want_y = _dense_expected(sc, x, token_slots, MODULES[name], y0)
        h = torch.full((module.count, 21, MAX_RANK), float("nan"))
        backend.shrink(x, sc.pool, h, batch, sc.slots, module, sc.layout)
        y = y0.clone()
        backend.expand(h, sc.pool, y, batch, sc.slots, module, sc.layout)
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
        (stream,) = [p for k, p in backend._plans.items()
                     if k[0] == "stream" and k[3:5] == (module.in_features, module.count)]
        ((_, expand),) = [p for k, p in backend._plans.items()
                          if k[0] == "expand" and k[1] == module.out_rows]
        assert (stream.meta["num_stages"], expand.meta["BK"], expand.meta["num_warps"]) == \
            (stages, expand_k, warps), name
        # 16 stream programs an SM (4 SMs on CPU) where tuned, against 8; one
        # expand program an SM: a grid-stride over every block.
        assert stream.grid[0] == (64 if name == "o" else 32)
        assert (expand.grid[0] == 1) == (name == "qkv") and batch.max_blocks > 1


def test_every_launch_takes_its_compile_options_from_its_tiles(monkeypatch):
    """Warps, stages and the register cap (`_options`) reach the split-K
    shrink's, the stream shrink's and the expand's launches alike."""
    from vllm_loraserve.kernels import triton_mbgmm

    monkeypatch.setattr(triton_mbgmm, "_options",
                        lambda t, device: dict(num_warps=t.num_warps, num_stages=t.num_stages,
                                               maxnreg=t.max_regs))  # as on CUDA
    given = []
    real = triton_mbgmm._shrink_kernel

    class Shrink:  # records the split-K shrink's launch options
        def __getitem__(self, grid):
            def launch(*args, **kw):
                given.append({k: kw[k] for k in ("num_warps", "num_stages", "maxnreg")})
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(triton_mbgmm, "_shrink_kernel", Shrink())
    sc = Scenario(4, torch.float32)
    token_slots = sc.token_slots(random.Random(4), 9)
    module = ModuleSlices.of(sc.layout, MODULES["qkv"])
    tiles = dict(num_warps=2, num_stages=3, max_regs=40)
    backend = TritonBackend(lambda b, k: Tiles(16, 16, split_k=1, **tiles),
                            lambda b, n: Tiles(16, 16, **tiles),
                            stream_tiles=lambda b, k: Tiles(JOB_ROWS, 16, **tiles))
    want = dict(num_warps=2, num_stages=3, maxnreg=40)
    for ranks in (None, sc.slots.rank):  # the split-K shrink, then the stream shrink
        batch = make_batch(token_slots, ranks=ranks)
        h = torch.zeros(module.count, 9, MAX_RANK)
        backend.shrink(torch.randn(9, HIDDEN), sc.pool, h, batch, sc.slots, module, sc.layout)
        backend.expand(h, sc.pool, torch.zeros(9, sum(module.out_features)), batch, sc.slots,
                       module, sc.layout)
    assert given == [want]
    for key, plan in backend._plans.items():
        launcher = plan[1] if key[0] == "expand" else plan
        assert {k: launcher.meta[k] for k in want} == want, key
    assert {k[0] for k in backend._plans} == {"stream", "expand"}
