"""The step's segment list (TokenBatch blocks): every token with an adapter
in exactly one block of its own slot, none without, within the bound a CUDA
graph captured (issue 23: SGLang's csgmv lost segments past a worst case);
and the shrink's jobs: every rank row of every block in exactly one job,
within that bound too."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.kernels import batch as batch_mod
from vllm_loraserve.kernels.batch import JOB_ROWS, SlotTable, TokenBatchBuffers
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec

MAX_TOKENS, MAX_SLOTS, MAX_RANK = 600, 24, 128


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-1, MAX_SLOTS - 1), min_size=1, max_size=MAX_TOKENS),
       st.sampled_from([16, 64]),
       st.lists(st.integers(1, MAX_RANK), min_size=MAX_SLOTS, max_size=MAX_SLOTS))
def test_blocks_cover_every_adapter_token_once_within_the_graph_bound(slots, block_m, ranks):
    buffers = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, block_m, MAX_RANK)
    # As DevicePool._plan bounds a step of this many tokens (what its graph captured).
    bound = -(-len(slots) // block_m) + min(len(slots), MAX_SLOTS)
    batch = buffers.bounded(buffers.fill(slots, ranks), bound)
    n = int(batch.num_blocks_dev[0])
    assert n == batch.num_blocks <= bound == batch.max_blocks
    blocks, order = batch.blocks[:n].numpy(), batch.sorted_tokens.numpy()
    covered = []
    for slot, start, length in blocks:
        assert 0 < length <= block_m
        tokens = order[start:start + length]
        assert all(slots[t] == slot for t in tokens)
        covered += tokens.tolist()
    assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0]
    _assert_rank_order(blocks, ranks)
    # Jobs: each block's rank rows [0, rank) in JOB_ROWS-row jobs, once each,
    # a job's row carrying its block's (slot, start, length).
    jobs = batch.jobs[:int(batch.num_jobs_dev[0])].numpy()
    assert len(jobs) <= batch.max_jobs
    block_of = {tuple(int(v) for v in row): b for b, row in enumerate(blocks)}
    assert len(block_of) == n
    job_blocks = [block_of[tuple(int(v) for v in job[:3])] for job in jobs]
    rows = sorted((b, int(job[3]) + i) for b, job in zip(job_blocks, jobs, strict=True)
                  for i in range(JOB_ROWS) if int(job[3]) + i < ranks[blocks[b][0]])
    assert rows == [(b, r) for b in range(n) for r in range(ranks[blocks[b][0]])]
    assert all(job[3] % JOB_ROWS == 0 and job[3] < ranks[job[0]] for job in jobs)


def _assert_rank_order(blocks: np.ndarray, ranks) -> None:
    """Blocks by decreasing rank (BLOCK_ORDER), a slot's blocks together and in order."""
    block_ranks = [ranks[slot] for slot in blocks[:, 0]]
    assert block_ranks == sorted(block_ranks, reverse=True)
    runs = [int(slot) for i, slot in enumerate(blocks[:, 0]) if i == 0 or slot != blocks[i - 1, 0]]
    assert len(runs) == len(set(runs))
    assert all(blocks[i, 1] < blocks[i + 1, 1] for i in range(len(blocks) - 1)
               if blocks[i, 0] == blocks[i + 1, 0])


def test_blocks_by_decreasing_rank_keep_each_slots_blocks_together_and_in_order():
    """Slots of several blocks each, and slots of equal rank (the property
    test above rarely draws either): ties keep the tokens' slot order."""
    rng = np.random.default_rng(1)
    ranks = np.array([8, 16, 32, 64, 128] * 5)[:MAX_SLOTS]
    slots = np.repeat(rng.permutation(MAX_SLOTS), 25)  # 25 tokens a slot: 2 blocks of 16
    rng.shuffle(slots)
    batch = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, 16, MAX_RANK).fill(slots, ranks)
    blocks = batch.blocks[:batch.num_blocks].numpy()
    assert len(blocks) == 2 * MAX_SLOTS
    _assert_rank_order(blocks, ranks)
    # Equal ranks: their slots in the tokens' grouping order (ascending slot id).
    for r in set(ranks.tolist()):
        firsts = [int(b[0]) for i, b in enumerate(blocks)
                  if ranks[b[0]] == r and (i == 0 or blocks[i - 1, 0] != b[0])]
        assert firsts == sorted(firsts)


def test_an_unknown_block_order_is_refused(monkeypatch):
    monkeypatch.setattr(batch_mod, "BLOCK_ORDER", "rnak")
    with pytest.raises(ValueError, match="BLOCK_ORDER"):
        TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, 16, MAX_RANK).fill([0, 1], [8, 8])


def _program_rows(blocks: np.ndarray, ranks: np.ndarray, programs: int) -> np.ndarray:
    """Rank rows each program of a grid-stride kernel reads (block b to program b mod P)."""
    return np.array([ranks[blocks[p::programs, 0]].sum() for p in range(programs)])


@pytest.mark.parametrize("seed", range(5))
def test_a_grid_stride_programs_rank_rows_are_within_the_largest_rank_of_each_other(
        monkeypatch, seed):
    """In rank order every program of a grid-stride launch reads within one
    block's rank rows of every other (a round-robin over decreasing costs),
    and the programs are more even than in slot order (the tokens' grouping),
    where one may read several times the rows of another."""
    rng = np.random.default_rng(seed)
    ranks = np.array([8, 16, 32, 64, 128])[rng.integers(0, 5, MAX_SLOTS)]
    weights = 1.0 / np.arange(1, MAX_SLOTS + 1)
    slots = rng.choice(MAX_SLOTS, size=MAX_TOKENS, p=weights / weights.sum())
    spreads = {}
    for order in ("rank", "slot"):
        monkeypatch.setattr(batch_mod, "BLOCK_ORDER", order)
        batch = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, 16, MAX_RANK).fill(slots, ranks)
        blocks = batch.blocks[:batch.num_blocks].numpy()
        spreads[order] = [np.ptp(_program_rows(blocks, ranks, p)) for p in (4, 7, 11)]
    assert max(spreads["rank"]) <= ranks.max()
    assert sum(spreads["rank"]) < sum(spreads["slot"])


def test_a_rank_above_the_buffers_max_is_refused():
    buffers = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, 16, max_rank=32)
    with pytest.raises(ValueError, match="exceeds the max_rank"):
        buffers.fill([0, 1], [64, 8])


def test_a_full_graph_batch_fits_both_block_heights():
    """The worst case each block height serves: every token its own slot's
    block tail (as many distinct adapters as slots)."""
    rng = np.random.default_rng(0)
    for block_m, num_tokens in ((16, MAX_TOKENS), (64, MAX_TOKENS)):
        slots = rng.integers(0, MAX_SLOTS, num_tokens)
        slots[:MAX_SLOTS] = np.arange(MAX_SLOTS)
        buffers = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, block_m, MAX_RANK)
        batch = buffers.fill(slots, np.full(MAX_SLOTS, MAX_RANK))
        assert sum(int(b[2]) for b in batch.blocks[:batch.num_blocks]) == num_tokens


@pytest.mark.parametrize("max_pages", [1, 5, 6, 8])
def test_every_slot_row_of_page_ids_starts_16_bytes_apart(max_pages):
    """A page load hands its slot's row of page ids to the page writer, and
    Triton compiles a kernel variant per pointer alignment: rows whose width
    was not a multiple of 4 ids made the first load into a slot whose row
    started off 16 bytes compile one while serving (vLLM's JIT monitor caught
    `_write_pages_kernel` at pool-1000, 77 ids a row)."""
    layout = LayerLayout((SliceSpec("q_proj", 64, 64),), page_size=256, align=16)
    table = SlotTable.empty(layout, max_slots=7, max_pages=max_pages, max_rank=16)
    assert table.pages.shape[1] >= max_pages
    assert all(table.pages[slot].data_ptr() % 16 == 0 for slot in range(7))
