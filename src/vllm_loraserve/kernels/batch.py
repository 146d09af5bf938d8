"""What the LoRA kernels read besides activations and the page pool.

- `SlotTable`: per adapter slot, its rank, segment offsets and page ids
  (paging/layout.py). Shared by every layer and module of a step.
- `TokenBatch`: the step's tokens grouped by slot and cut into work blocks
  of at most `block_m` tokens, one slot per block. Tokens without an adapter
  are in no block, so the kernels never touch them. Where the slots' ranks
  are known, the blocks come by decreasing rank (`BLOCK_ORDER`), and with
  them the shrink's jobs: one per (block, `JOB_ROWS` rank rows
  of its slot), so its grid follows the sum of the ranks in the step, not
  the largest rank. `TokenBatchBuffers` keeps them in persistent tensors
  for CUDA-graph replay.
- `ModuleSlices`: which consecutive slices of the layout one vLLM LoRA layer
  computes (qkv_proj: q, k, v) and where each lands in its output.

All are built on the host once per step (or once per model) and handed to
the kernels as device tensors. The kernels' grids depend on `max_blocks`
and on `SlotTable.max_rank`, never on the ranks in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_loraserve.paging.layout import AdapterPlacement, LayerLayout


class RowStaging:
    """Pinned host rows, one per slot, that `SlotTable.write` copies from
    asynchronously (a pageable copy would make the host wait for every
    kernel already queued). Allocated with the table: a pinned tensor per
    write would pin a new block (`cudaHostRegister`, milliseconds, stalling
    the engine's launches) whenever a step's writes outnumber the free
    blocks of torch's pinned allocator. A row is rewritten only once its
    last copy is done."""

    def __init__(self, slots: int, width: int) -> None:
        self.rows = torch.zeros(slots, width, dtype=torch.int32, pin_memory=True)
        self._copied: list[torch.cuda.Event | None] = [None] * slots

    def fill(self, slot: int, values: Sequence[int]) -> torch.Tensor:
        done = self._copied[slot]
        if done is not None:
            done.synchronize()
        row = self.rows[slot, :len(values)]
        row.numpy()[:] = values
        return row

    def issued(self, slot: int) -> None:
        """The row's copies are queued on the current stream."""
        event = self._copied[slot] or torch.cuda.Event()
        event.record()
        self._copied[slot] = event


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


PAGE_ROW_ALIGN = 4  # int32 page ids: 16 bytes (`SlotTable.empty`)


@dataclass(frozen=True)
class SlotTable:
    rank: torch.Tensor  # [S] int32; 0 for an empty slot
    seg_offsets: torch.Tensor  # [S, num_segments] int32; -1 where not targeted
    pages: torch.Tensor  # [S, max_pages] int32
    max_rank: int  # the largest rank any slot may hold (bounds kernel grids)
    staging: RowStaging | None = None  # `write`'s host rows, on a CUDA device

    @classmethod
    def build(
        cls,
        layout: LayerLayout,
        slots: Sequence[tuple[AdapterPlacement, Sequence[int]] | None],
        max_rank: int,
        device: torch.device | str = "cpu",
    ) -> SlotTable:
        """`slots[i]` is (placement, page ids) of the adapter in slot i, or None."""
        max_pages = max([len(s[1]) for s in slots if s is not None] + [1])
        rank = np.zeros(len(slots), np.int32)
        segs = np.full((len(slots), layout.num_segments), -1, np.int32)
        pages = np.zeros((len(slots), max_pages), np.int32)
        for i, s in enumerate(slots):
            if s is None:
                continue
            placement, page_ids = s
            if placement.rank > max_rank:
                raise ValueError(f"slot {i}: rank {placement.rank} > max_rank {max_rank}")
            if len(page_ids) != placement.num_pages:
                raise ValueError(f"slot {i}: {len(page_ids)} pages for a placement that "
                                 f"needs {placement.num_pages}")
            rank[i] = placement.rank
            segs[i] = placement.seg_offsets
            pages[i, :len(page_ids)] = page_ids
        as_t = functools.partial(torch.as_tensor, device=device)
        return cls(as_t(rank), as_t(segs), as_t(pages), max_rank)

    @classmethod
    def empty(cls, layout: LayerLayout, max_slots: int, max_pages: int, max_rank: int,
              device: torch.device | str = "cpu") -> SlotTable:
        """A persistent table of `max_slots` empty slots, filled in place by
        `write` and `clear` (CUDA graphs keep its addresses). Rows hold a
        multiple of PAGE_ROW_ALIGN page ids, so every row starts 16 bytes
        apart: a page load passes its row to the page writer, and Triton
        compiles a kernel variant per pointer alignment (a row starting off
        16 bytes would compile one while serving)."""
        cuda = torch.device(device).type == "cuda"
        max_pages = _round_up(max_pages, PAGE_ROW_ALIGN)
        return cls(torch.zeros(max_slots, dtype=torch.int32, device=device),
                   torch.full((max_slots, layout.num_segments), -1, dtype=torch.int32,
                              device=device),
                   torch.zeros(max_slots, max_pages, dtype=torch.int32, device=device),
                   max_rank,
                   RowStaging(max_slots, 1 + layout.num_segments + max_pages) if cuda else None)

    def write(self, slot: int, placement: AdapterPlacement, page_ids: Sequence[int]) -> None:
        if placement.rank > self.max_rank or len(page_ids) > self.pages.shape[1]:
            raise ValueError(f"slot {slot}: rank {placement.rank} in {len(page_ids)} pages "
                             f"exceeds the table (rank {self.max_rank}, "
                             f"{self.pages.shape[1]} pages)")
        segs = len(placement.seg_offsets)
        values = [placement.rank, *placement.seg_offsets, *page_ids]
        row = (torch.tensor(values, dtype=torch.int32) if self.staging is None
               else self.staging.fill(slot, values))
        self.rank[slot:slot + 1].copy_(row[:1], non_blocking=True)
        self.seg_offsets[slot].copy_(row[1:1 + segs], non_blocking=True)
        self.pages[slot, :len(page_ids)].copy_(row[1 + segs:], non_blocking=True)
        if self.staging is not None:
            self.staging.issued(slot)

    def clear(self, slot: int) -> None:
        # fill_ queues a kernel. `rank[slot] = 0` copies a host scalar, which
        # made every page load wait for the step in flight on the GPU (~68 ms
        # a load in the e2e protocol: benchmarks/e2e/load_host_time.py).
        self.rank[slot:slot + 1].fill_(0)
        self.seg_offsets[slot].fill_(-1)


JOB_ROWS = 32  # rank rows per shrink job (the shrink's tile height over the rank)


JOB_COLS = 4  # a job's row: its block's (slot, start, length), then its first rank row


BLOCK_ORDER = "rank"
"""How a step's work blocks are ordered where their slots' ranks are known
(`TokenBatchBuffers.fill`, `TokenBatch.build` with ranks): "rank", by
decreasing rank of their slot (stable: a slot's blocks stay together, in
order), or "slot", as the tokens group them. The expand gives block b to
program b mod P (the shrink of such a batch runs on its jobs, stream-K, and
balances itself). Over a list of decreasing ranks, each program's rank rows
then sum to within the largest rank of every other's, and the heaviest
blocks start first; in slot order one program may draw several rank-128
blocks and another only rank 8s, and a launch lasts as long as its heaviest
program. benchmarks/kernels/engine_grid.py --block-orders sets it for its A/B."""
BLOCK_ORDERS = ("rank", "slot")


def _ordered(blocks: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """`blocks` in BLOCK_ORDER; `ranks[slot]` the rank of the adapter in `slot`."""
    if BLOCK_ORDER not in BLOCK_ORDERS:
        raise ValueError(f"BLOCK_ORDER {BLOCK_ORDER!r}: one of {BLOCK_ORDERS}")
    if BLOCK_ORDER == "slot" or not len(blocks):
        return blocks
    return blocks[np.argsort(-ranks[blocks[:, 0]], kind="stable")]


def _ordered_with_jobs(blocks: np.ndarray, ranks) -> tuple[np.ndarray, np.ndarray]:
    """`blocks` in BLOCK_ORDER and their shrink jobs, given the slots' ranks."""
    ranks = np.asarray(ranks.cpu() if isinstance(ranks, torch.Tensor) else ranks,
                       dtype=np.int64)
    blocks = _ordered(blocks, ranks)
    return blocks, _jobs(blocks, ranks)


def _jobs(blocks: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """A row per JOB_ROWS rows of each block's slot rank, blocks in order:
    the block's (slot, start, length) and the first of those rank rows
    (the shrink reads the block with the job, not after it). Together they
    cover each block's rank rows exactly once. `ranks[slot]` is the rank of
    the adapter in `slot`."""
    tiles = -(-ranks[blocks[:, 0]] // JOB_ROWS) if len(blocks) else np.zeros(0, np.int64)
    block = np.repeat(np.arange(len(blocks)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    rows = ((np.arange(len(block)) - first) * JOB_ROWS)[:, None]
    return np.concatenate([blocks.reshape(-1, 3)[block], rows],
                          axis=1).astype(np.int32).reshape(-1, JOB_COLS)


def _group_tokens(token_slots, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Token indices grouped by slot (stable) and (slot, start, length) blocks."""
    slots = np.asarray(token_slots.cpu() if isinstance(token_slots, torch.Tensor)
                       else token_slots, dtype=np.int64)
    with_adapter = np.flatnonzero(slots >= 0)
    order = with_adapter[np.argsort(slots[with_adapter], kind="stable")]
    # Vectorised (the host builds this every step, over ~100 adapters): slot
    # i's count c_i gives ceil(c_i / block_m) blocks from its first token on.
    uniq, counts = np.unique(slots[order], return_counts=True)
    per_slot = -(-counts // block_m)
    first = np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
    offset = (np.arange(int(per_slot.sum())) - first) * block_m  # within the slot's tokens
    starts = np.repeat(np.cumsum(counts) - counts, per_slot) + offset
    lengths = np.minimum(block_m, np.repeat(counts, per_slot) - offset)
    blocks = np.stack([np.repeat(uniq, per_slot), starts, lengths], axis=1)
    return order.astype(np.int32), blocks.astype(np.int32).reshape(-1, 3)


@dataclass(frozen=True)
class TokenBatch:
    """Invariant: rows [0, num_blocks) of `blocks` are the batch's blocks,
    and rows [0, num_jobs) of `jobs` its shrink jobs (`_jobs`); the kernels'
    grids depend on `max_blocks` and `max_jobs` only, and read the counts on
    the device. `jobs` is None where the ranks were not given: the shrink
    then covers every rank row up to the slot table's largest rank."""

    num_tokens: int
    sorted_tokens: torch.Tensor  # [>= tokens with an adapter] int32, grouped by slot
    blocks: torch.Tensor  # [max_blocks, 3] int32: (slot, start in sorted_tokens, length)
    num_blocks_dev: torch.Tensor  # [1] int32, on the kernels' device
    num_blocks: int
    block_m: int
    jobs: torch.Tensor | None = None  # [max_jobs, JOB_COLS] int32 (`_jobs`)
    num_jobs_dev: torch.Tensor | None = None  # [1] int32, on the kernels' device

    @classmethod
    def build(cls, token_slots: Sequence[int] | np.ndarray | torch.Tensor, block_m: int,
              device: torch.device | str = "cpu", ranks=None) -> TokenBatch:
        """A batch in tensors of its own size (eager launches). `token_slots[t]`
        is token t's slot, or -1 for no adapter; `ranks[slot]`, where given,
        the rank of the adapter in each slot (for the shrink's jobs)."""
        order, blocks = _group_tokens(token_slots, block_m)
        as_t = functools.partial(torch.as_tensor, dtype=torch.int32, device=device)
        jobs = None
        if ranks is not None:
            blocks, jobs = _ordered_with_jobs(blocks, ranks)
        return cls(len(token_slots), as_t(order), as_t(blocks), as_t([len(blocks)]),
                   len(blocks), block_m, None if jobs is None else as_t(jobs),
                   None if jobs is None else as_t([len(jobs)]))

    @property
    def max_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def max_jobs(self) -> int:
        return 0 if self.jobs is None else self.jobs.shape[0]


class TokenBatchBuffers:
    """Persistent metadata buffers for CUDA-graph replay.

    A graph captured with a batch from `fill` replays correctly for any later
    `fill` of the same buffers with at most `max_tokens` tokens: the grids
    (`max_blocks`, `max_jobs`) and every tensor address stay fixed; only
    contents change. A block holds at most `job_tiles` jobs (its slot's rank
    is at most `max_rank`), so `jobs[:bound * job_tiles]` holds every job of
    a batch of at most `bound` blocks.

    The five tensors are views of one device buffer, written each step by a
    single asynchronous copy from pinned host memory (two staging buffers in
    turn, each reused only once its previous copy is done), so a step never
    waits for the GPU to finish the one before it.
    """

    def __init__(self, max_tokens: int, max_slots: int, block_m: int, max_rank: int,
                 device: torch.device | str = "cpu") -> None:
        self.max_tokens, self.block_m = max_tokens, block_m
        # Each slot adds at most one partial block.
        max_blocks = -(-max_tokens // block_m) + min(max_tokens, max_slots)
        self.job_tiles = -(-max_rank // JOB_ROWS)
        max_jobs = max_blocks * self.job_tiles
        # Each view starts 16-byte aligned: Triton specialises a kernel on
        # its pointers' alignment, so the views must be the ones it was
        # compiled for at warm-up (worker/pool.py), whatever the sizes.
        self._blocks_at = _round_up(max_tokens, 4)
        self._jobs_at = self._blocks_at + _round_up(3 * max_blocks, 4)
        self._count_at = self._jobs_at + _round_up(JOB_COLS * max_jobs, 4)
        size = self._count_at + 8
        self._device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.sorted_tokens = self._device_buf[:max_tokens]
        self.blocks = self._device_buf[self._blocks_at:self._blocks_at + 3 * max_blocks].view(
            max_blocks, 3)
        self.jobs = self._device_buf[self._jobs_at:self._jobs_at + JOB_COLS * max_jobs].view(
            max_jobs, JOB_COLS)
        self.num_blocks = self._device_buf[self._count_at:self._count_at + 1]
        self.num_jobs = self._device_buf[self._count_at + 4:self._count_at + 5]
        cuda = torch.device(device).type == "cuda"
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(2 if cuda else 1)]
        self._copied = [torch.cuda.Event() if cuda else None for _ in self._staging]
        self._turn = 0

    def fill(self, token_slots: Sequence[int] | np.ndarray | torch.Tensor,
             ranks) -> TokenBatch:
        """`ranks[slot]`: the rank of the adapter in each slot the tokens name
        (at most the `max_rank` the buffers were made for)."""
        if len(token_slots) > self.max_tokens:
            raise ValueError(f"{len(token_slots)} tokens > buffer capacity {self.max_tokens}")
        order, blocks = _group_tokens(token_slots, self.block_m)
        blocks, jobs = _ordered_with_jobs(blocks, ranks)
        if len(jobs) and jobs[:, 3].max() >= self.job_tiles * JOB_ROWS:
            raise ValueError("a slot's rank exceeds the max_rank the buffers were made for")
        self._turn = (self._turn + 1) % len(self._staging)
        host, done = self._staging[self._turn], self._copied[self._turn]
        if done is not None:
            done.synchronize()
        host_np = host.numpy()
        host_np[:len(order)] = order
        host_np[self._blocks_at:self._blocks_at + blocks.size] = blocks.reshape(-1)
        host_np[self._jobs_at:self._jobs_at + jobs.size] = jobs.reshape(-1)
        host_np[self._count_at] = len(blocks)
        host_np[self._count_at + 4] = len(jobs)
        self._device_buf.copy_(host, non_blocking=True)
        if done is not None:
            done.record()
        return TokenBatch(len(token_slots), self.sorted_tokens, self.blocks, self.num_blocks,
                          len(blocks), self.block_m, self.jobs, self.num_jobs)

    def bounded(self, batch: TokenBatch, bound: int) -> TokenBatch:
        """`batch` with grids for at most `bound` blocks (a CUDA graph's
        token count): its blocks and jobs views cut to that capacity."""
        return dataclasses.replace(batch, blocks=self.blocks[:bound],
                                   jobs=self.jobs[:bound * self.job_tiles])


@dataclass(frozen=True)
class ModuleSlices:
    """Slices `first .. first+count-1` of a layout, sharing one input."""

    first: int
    count: int
    in_features: int
    out_features: tuple[int, ...]

    @classmethod
    def of(cls, layout: LayerLayout, names: Sequence[str]) -> ModuleSlices:
        idx = [layout.slice_index(n) for n in names]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(f"slices {list(names)} are not consecutive in the layout")
        specs = [layout.slices[g] for g in idx]
        if len({s.in_features for s in specs}) != 1:
            raise ValueError(f"slices {list(names)} do not share one input size")
        return cls(idx[0], len(idx), specs[0].in_features, tuple(s.out_features for s in specs))

    @functools.cached_property
    def out_offsets(self) -> tuple[int, ...]:
        """Column of each slice's first output in the module's output."""
        return tuple(int(x) for x in np.cumsum((0, *self.out_features))[:-1])

    @functools.cached_property
    def out_rows(self) -> tuple[tuple[int, int], ...]:
        """(output columns, first output column) per slice."""
        return tuple(zip(self.out_features, self.out_offsets, strict=True))
