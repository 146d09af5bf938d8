"""The step's segment list (TokenBatch blocks): every token with an adapter
in exactly one block of its own slot, none without, within the bound a CUDA
graph captured (issue 23: SGLang's csgmv lost segments past a worst case)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_loraserve.kernels.batch import TokenBatchBuffers

MAX_TOKENS, MAX_SLOTS = 600, 24


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-1, MAX_SLOTS - 1), min_size=1, max_size=MAX_TOKENS),
       st.sampled_from([16, 64]))
def test_blocks_cover_every_adapter_token_once_within_the_graph_bound(slots, block_m):
    buffers = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, block_m)
    # As DevicePool._shape bounds a step of this many tokens (what its graph captured).
    bound = -(-len(slots) // block_m) + min(len(slots), MAX_SLOTS)
    batch = buffers.fill(slots)
    n = int(batch.num_blocks_dev[0])
    assert n == batch.num_blocks <= bound <= buffers.blocks.shape[0]
    blocks, order = batch.blocks[:n].numpy(), batch.sorted_tokens.numpy()
    covered = []
    for slot, start, length in blocks:
        assert 0 < length <= block_m
        tokens = order[start:start + length]
        assert all(slots[t] == slot for t in tokens)
        covered += tokens.tolist()
    assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0]


def test_a_full_graph_batch_fits_both_block_heights():
    """The worst case each block height serves: every token its own slot's
    block tail (as many distinct adapters as slots)."""
    rng = np.random.default_rng(0)
    for block_m, num_tokens in ((16, MAX_TOKENS), (64, MAX_TOKENS)):
        slots = rng.integers(0, MAX_SLOTS, num_tokens)
        slots[:MAX_SLOTS] = np.arange(MAX_SLOTS)
        buffers = TokenBatchBuffers(MAX_TOKENS, MAX_SLOTS, block_m)
        batch = buffers.fill(slots)
        assert sum(int(b[2]) for b in batch.blocks[:batch.num_blocks]) == num_tokens
