"""One worker's view of the unified pool: KV tensors as adapter pages.

`DevicePool` holds what every paged LoRA layer of a step reads:
- `pages[l]`: layer l's KV cache tensor seen as [num_blocks, page_size]
  elements (block id b = page b; paging/layout.py);
- the slot table (rank, segment offsets, page ids of each resident adapter),
  changed only by `PoolStep`s from the scheduler (paging/step.py);
- the step's token batches (tokens grouped by slot), set before the forward;
- `h`, the shrink output buffer.

Every tensor the kernels read is allocated once and changed in place, so a
CUDA graph captured with any batch replays correctly with a later one: the
kernels' grids depend only on the number of tokens, and programs past the
step's real work blocks (read on the device) return at once. Work blocks
are 16 tokens high (MBGMV), but in a prefill-heavy step: the adapters with
`TALL` tokens or more, when they hold more than `SMALL_BATCH` tokens
together, run in 64-token blocks (MBGMM), in a second launch of shrink and
expand. Only then do their 64-token blocks fill the GPU; a few of them
alone take longer than their weights re-read in 16-token blocks. Only a
layer input of more than `SMALL_BATCH` rows can take the second launch, so
which launches a layer makes depends on its row count only, the same at
capture and at replay.

A load writes every layer's pages at once (`load`), or, for a pipelined or
CPU-assisted cold start (worker/cold_start.py), takes its slot first
(`begin_load`) and writes its layer groups one by one (`write_group`); a
`LayerGate` then runs beside each layer's kernels (waits for the layer's
group, CPU deltas), and a slot can be hidden from the kernels while its
pages are written (`hide`, `show`).

Invariant: a token's adapter id maps to a slot only if that adapter's pages
were written in this or an earlier step, or are being written in this step
under a gate that orders each layer after its group's writes; a real adapter
id without a slot is an error, never silently served without its adapter.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from vllm_loraserve.kernels import SlotTable, get_backend
from vllm_loraserve.kernels.batch import ModuleSlices, TokenBatch, TokenBatchBuffers
from vllm_loraserve.kernels.tile_table import TileTable
from vllm_loraserve.paging.layout import AdapterPlacement, LayerLayout, SliceSpec

# The split rule's thresholds, from engine_grid.py on an H200 (Llama-3-8B
# all-linear, 200 adapters; docs/benchmarks/kernels.md, 2026-11-25 session
# 11): 16-token blocks were faster for decode steps of up to 2048 tokens,
# whose busiest adapter holds a few hundred tokens; 64-token blocks for the
# adapters of prefill chunks once they held 4096 tokens or more.
SMALL_BATCH = 4096  # rows; an input of at most this many runs in 16-token blocks only
TALL = 256  # tokens of one adapter in a step from which it may get 64-token blocks
# The batchings of a layer input above SMALL_BATCH rows, by rule: each a
# (token set, block height). "split" serves; the others are the A/B of
# benchmarks/kernels/engine_grid.py (--rules).
LARGE_RULES: dict[str, tuple[tuple[str, int], ...]] = {
    "split": (("short", 16), ("tall", 64)),
    "all64": (("all", 64),),
    "all16": (("all", 16),),
}
SMALL = ("all", 16)


@dataclasses.dataclass(frozen=True)
class _Resident:
    """One slot's adapter, as `load` wrote it."""

    lora_id: int
    placement: AdapterPlacement
    page_ids: tuple[int, ...]
    # Bytes of A and B it holds in all layers (row padding excluded): what a
    # step's kernels read of it. Counted at load, so a step only adds ints.
    weight_bytes: int


class LayerGate(Protocol):
    """What runs beside each paged LoRA layer of a step (worker/cold_start.py)."""

    def set_tokens(self, token_slots: np.ndarray) -> None:
        """The step's token -> slot map (-1: no adapter)."""

    def before_layer(self, layer: int, x: torch.Tensor) -> None:
        """Before the layer's kernels read its pages."""

    def after_layer(self, layer: int, module: ModuleSlices, x: torch.Tensor,
                    y: torch.Tensor) -> None:
        """After the layer's kernels added into y."""


def capturing(x: torch.Tensor) -> bool:
    """A CUDA graph is being captured on x's stream: it must hold every launch
    a later replay may need, so no launch is skipped for an empty batch."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def page_view(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """A blocks-first KV tensor as [num_blocks, page_size] (same storage)."""
    n = kv.shape[0]
    if kv[0].numel() != page_size or kv.stride(0) != page_size:
        raise ValueError(f"KV cache {tuple(kv.shape)} (strides {kv.stride()}) is not "
                         f"blocks-first with {page_size}-element pages; the pool cannot "
                         "share it (use --loraserve-pool vllm)")
    return torch.as_strided(kv, (n, page_size), (page_size, 1), kv.storage_offset())


def plan(num_tokens: int, max_slots: int, large_rule: str
         ) -> tuple[tuple[tuple[str, int], int], ...]:
    """The batchings a layer input of `num_tokens` rows launches, each as
    (buffer key, most blocks): what the kernels' launches depend on. A
    buffer key is (token set, block height)."""
    keys = (SMALL,) if num_tokens <= SMALL_BATCH else LARGE_RULES[large_rule]
    return tuple((key, -(-num_tokens // key[1]) + min(num_tokens, max_slots)) for key in keys)


class DevicePool:
    """Built with the model, before vLLM profiles and compiles it (the layers
    must call the pool from their first trace, and the buffers count as model
    memory); `bind` attaches it to the KV cache once vLLM has made it."""

    def __init__(self, slices: tuple[SliceSpec, ...], num_layers: int, max_rank: int,
                 max_tokens: int, max_slots: int, max_slices: int, backend: str,
                 device: torch.device, large_rule: str = "split",
                 layer_groups: tuple[range, ...] = (), tiles: TileTable | None = None) -> None:
        """`layer_groups`: the layer ranges `write_group` writes (none: every
        load writes all layers at once); `tiles`: the kernels' tuned tiles."""
        self.slices, self.num_layers, self.max_rank = slices, num_layers, max_rank
        self.layer_groups = layer_groups
        self.gate: LayerGate | None = None
        self.device, self.max_slots = device, max_slots
        self.backend = get_backend(backend, tiles)
        self.layout: LayerLayout | None = None
        self.table: SlotTable | None = None
        # The shrinks' output h: two buffers in turn, each token-major ([tokens,
        # slices, rank]) so that a step's rows are one range. Each shrink
        # zeroes the other buffer's for the next one, which then needs no
        # memset launch; only a forward's first shrink zeroes its own h.
        self._h_dims = (max_tokens, max_slices, max_rank)
        size = -(-max_tokens * max_slices * max_rank // 16) * 16  # buffers 64-byte aligned
        self._h = torch.zeros(2, size, dtype=torch.float32, device=device)
        self._h_turn = 0  # the buffer the next shrink writes
        self._h_zeroed: int | None = None  # tokens whose rows of that buffer are zero
        self._last_call = (-1, -1)  # (layer, first slice) of the last add_lora
        if large_rule not in LARGE_RULES:
            raise ValueError(f"unknown large-batch rule {large_rule!r}: {sorted(LARGE_RULES)}")
        self.large_rule = large_rule
        self._buffers = {key: TokenBatchBuffers(max_tokens, max_slots, key[1], max_rank, device)
                         for key in {SMALL, *LARGE_RULES[large_rule]}}
        self._batches: dict[tuple[str, int], TokenBatch] = {}  # the keys filled this step
        self._step: tuple[np.ndarray, np.ndarray] | None = None  # its token slots, slot ranks
        self._sets: dict[str, np.ndarray] | None = None  # its token sets, once one is filled
        self._largest_graph = 0  # rows of the largest CUDA graph captured
        self.active = False  # the step has LoRA requests (warm-up dummies count)
        self.pages: list[torch.Tensor] | None = None
        self.slots: dict[int, _Resident] = {}
        self.slot_of: dict[int, int] = {}  # lora id -> slot
        self.peak_batch_adapters = 0  # most distinct adapters in one step so far
        # Over the steps with adapter tokens: how many, distinct adapters,
        # their ranks summed (the kernels read sum-of-ranks rows per layer),
        # and the bytes of A and B they hold in all layers (what the step's
        # kernels must read at least once: the memory roofline).
        self.adapter_steps = self.adapter_step_adapters = self.adapter_step_ranks = 0
        self.adapter_step_bytes = 0

    def warm_up(self, modules: set[ModuleSlices]) -> int:
        """Launch, once bound, every kernel variant serving can launch, with
        no work: the page writer, and shrink and expand of each module kind
        for the batch shapes of every token count up to `max_tokens`, so no
        kernel compiles while serving (vLLM's JIT monitor watches from its
        warm-up's end). Returns the number of variants launched."""
        assert self.pages is not None, "the pool is not bound to the KV cache yet"
        # vLLM's null block (id 0) is never handed out: written with itself.
        page0 = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._write_pages(page0, torch.stack([p[0] for p in self.pages]))
        # The buffers' own views (Triton specialises on their alignment), with
        # no blocks: nothing is computed. No step has filled them yet.
        for buffers in self._buffers.values():
            buffers.num_blocks.zero_()
            buffers.num_jobs.zero_()
        shapes = sorted({shape for t in range(1, self._h_dims[0] + 1)
                         for shape in self._plan(t)})
        batches = []
        for key, bound in shapes:
            buf = self._buffers[key]
            empty = TokenBatch(1, buf.sorted_tokens, buf.blocks, buf.num_blocks, 0, key[1],
                               buf.jobs, buf.num_jobs)
            batches.append(buf.bounded(empty, bound))
        variants, dtype = 1, self.pages[0].dtype  # activations too (the scheduler checks)
        for module in sorted(modules, key=lambda m: m.first):
            x = torch.zeros(1, module.in_features, dtype=dtype, device=self.device)
            y = torch.zeros(1, sum(module.out_features), dtype=dtype, device=self.device)
            variants += self.backend.warm_up(x, self.pages[0], self.h_view(0, module.count, 1),
                                             y, batches, self.table, module, self.layout)
        return variants

    # -- residency (from PoolSteps) ---------------------------------------
    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        """Use the KV cache tensors (one per layer, blocks-first) as pages."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV cache tensors for {self.num_layers} layers")
        self.layout = LayerLayout(self.slices, kv_caches[0][0].numel())
        max_pages = self.layout.place(self.max_rank, [s.name for s in self.slices]).num_pages
        self.table = SlotTable.empty(self.layout, self.max_slots, max_pages, self.max_rank,
                                     self.device)
        self.pages = [page_view(kv, self.layout.page_size) for kv in kv_caches]
        self._write_pages = self.backend.page_writer(self.pages)
        self._group_writers = [self.backend.page_writer(self.pages[g.start:g.stop])
                               for g in self.layer_groups]

    def evict(self, slot: int) -> None:
        entry = self.slots.pop(slot, None)
        if entry is not None and self.slot_of.get(entry.lora_id) == slot:
            del self.slot_of[entry.lora_id]
        self.table.clear(slot)

    def load(self, slot: int, lora_id: int, placement: AdapterPlacement,
             page_ids: tuple[int, ...], streams: torch.Tensor) -> None:
        """Write an adapter's per-layer streams ([layers, pages * page_size])
        into its pages of every layer, and give it `slot`."""
        # On the current stream: ordered after every kernel that read these
        # pages before (as KV or as another adapter) and before this step's.
        # The slot's table row goes first: the page writes read their ids from it.
        self.begin_load(slot, lora_id, placement, page_ids)
        self._write_pages(self.table.pages[slot, :len(page_ids)], streams)

    def begin_load(self, slot: int, lora_id: int, placement: AdapterPlacement,
                   page_ids: tuple[int, ...]) -> None:
        """Give an adapter `slot` and write its table row (on the current
        stream), before its pages: `load` or `write_group` write those."""
        assert self.pages is not None, "the pool is not bound to the KV cache yet"
        if len(page_ids) != placement.num_pages:
            raise ValueError(f"{len(page_ids)} pages for an adapter that needs "
                             f"{placement.num_pages}")
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside the table's {self.max_slots} slots")
        self.evict(slot)
        self.table.write(slot, placement, page_ids)
        weight_bytes = (self.layout.weight_elements(placement) * self.num_layers
                        * self.pages[0].element_size())
        self.slots[slot] = _Resident(lora_id, placement, page_ids, weight_bytes)
        self.slot_of[lora_id] = slot

    def write_group(self, slot: int, group: int, streams: torch.Tensor) -> None:
        """Write the pages of layer group `group` (`layer_groups[group]`;
        `streams`: one row per layer of it) of the adapter `begin_load` put in
        `slot`, on the current stream, which must be ordered after that
        table row's write."""
        page_ids = self.slots[slot].page_ids
        self._group_writers[group](self.table.pages[slot, :len(page_ids)], streams)

    def hide(self, slot: int) -> None:
        """The kernels skip `slot`'s tokens (its row: rank 0, no segments)
        until `show`, on the current stream; it keeps its adapter and pages."""
        self.table.clear(slot)

    def show(self, slot: int) -> None:
        """The kernels read `slot` again (its row written back)."""
        resident = self.slots[slot]
        self.table.write(slot, resident.placement, resident.page_ids)

    def pages_of(self, lora_id: int) -> int:
        return len(self.slots[self.slot_of[lora_id]].page_ids)

    @property
    def pages_held(self) -> int:
        return sum(len(r.page_ids) for r in self.slots.values())

    # -- per step -----------------------------------------------------------
    def set_tokens(self, token_lora_ids: np.ndarray, ignored_ids: set[int]) -> None:
        """The step's token -> adapter map (lora int ids, 0 = none). Ids in
        `ignored_ids` (vLLM's warm-up dummies) count as no adapter."""
        ids = np.asarray(token_lora_ids, dtype=np.int64)
        self.active = bool((ids > 0).any())
        used = set(np.unique(ids[ids > 0]).tolist()) - ignored_ids
        self.peak_batch_adapters = max(self.peak_batch_adapters, len(used))
        missing = used - self.slot_of.keys()
        if missing:
            raise RuntimeError(f"adapters {sorted(missing)} are scheduled but not resident "
                               "in the pool (scheduler and worker disagree)")
        lut = np.full(int(ids.max(initial=0)) + 1, -1, dtype=np.int64)
        ranks = np.zeros(self.max_slots, dtype=np.int64)
        for lora_id in used:
            slot = lut[lora_id] = self.slot_of[lora_id]
            resident = self.slots[slot]
            ranks[slot] = resident.placement.rank
            self.adapter_step_ranks += resident.placement.rank
            self.adapter_step_bytes += resident.weight_bytes
        if used:
            self.adapter_steps += 1
            self.adapter_step_adapters += len(used)
        token_slots = np.where(ids > 0, lut[np.maximum(ids, 0)], -1)
        self._step, self._sets = (token_slots, ranks), None
        # A step's forward starts here, whether the host runs it or replays a
        # graph: nothing zeroed in an earlier forward is trusted (add_lora).
        self._h_turn, self._h_zeroed, self._last_call = 0, None, (-1, -1)
        self._batches = {}
        for key in self._keys_for(len(ids)):
            self._fill(key)
        if self.gate is not None:
            self.gate.set_tokens(token_slots)

    @staticmethod
    def _token_sets(token_slots: np.ndarray) -> dict[str, np.ndarray]:
        """Each token set, as `token_slots` with the tokens outside it as -1
        (no block): "all"; "tall", the tokens of adapters with at least TALL
        of them, if there are more than SMALL_BATCH such tokens, else none;
        "short", the rest."""
        counts = np.bincount(token_slots[token_slots >= 0], minlength=1)
        tall = (counts[np.maximum(token_slots, 0)] >= TALL) & (token_slots >= 0)
        if tall.sum() <= SMALL_BATCH:
            tall[:] = False
        return {"all": token_slots, "tall": np.where(tall, token_slots, -1),
                "short": np.where(tall, -1, token_slots)}

    def _plan(self, num_tokens: int) -> tuple[tuple[tuple[str, int], int], ...]:
        return plan(num_tokens, self.max_slots, self.large_rule)

    def _keys_for(self, num_tokens: int) -> set[tuple[str, int]]:
        """The buffers a step of `num_tokens` tokens fills in set_tokens (each
        fill groups the tokens on the host: about 0.2 ms): those of its layer
        inputs' plans. An input has `num_tokens` rows, or is padded to a
        captured graph's size, at most the largest one's. A graph replays the
        buffers its capture's plan read, so those are filled for any step it
        may run; an eager input padded past them fills its own (`_batches_for`)."""
        keys = {key for key, _ in self._plan(num_tokens)}
        if num_tokens <= self._largest_graph:
            keys |= {key for key, _ in self._plan(self._largest_graph)}
        return keys

    def _fill(self, key: tuple[str, int]) -> TokenBatch:
        token_slots, ranks = self._step
        if key[0] != "all" and self._sets is None:  # the large rule's buffers share them
            self._sets = self._token_sets(token_slots)
        tokens = token_slots if key[0] == "all" else self._sets[key[0]]
        batch = self._batches[key] = self._buffers[key].fill(tokens, ranks)
        return batch

    def _batches_for(self, num_tokens: int, graph: bool = False) -> list[TokenBatch]:
        """The step's batches for a layer input of `num_tokens` rows (padded
        for a CUDA graph, possibly): grids bounded by that count alone.
        `graph`: the launches are being captured (a fill now would not be
        part of the graph's replays)."""
        out = []
        for key, bound in self._plan(num_tokens):
            batch = self._batches.get(key)
            if batch is None:
                if graph:
                    raise RuntimeError(f"a CUDA graph of {num_tokens} rows needs the {key} "
                                       "token batch, which set_tokens did not fill")
                batch = self._fill(key)  # an eager input padded past the step's tokens
            if batch.blocks.shape[0] != bound:
                batch = self._batches[key] = self._buffers[key].bounded(batch, bound)
            out.append(batch)
        return out

    def _h_rows(self, turn: int, tokens: int) -> torch.Tensor:
        """h buffer `turn`'s rows of the first `tokens` tokens, one flat range."""
        _, slices, rank = self._h_dims
        return self._h[turn, :tokens * slices * rank]

    def h_view(self, turn: int, count: int, tokens: int) -> torch.Tensor:
        """h buffer `turn`'s first `count` slices for `tokens` tokens, as the
        kernels take it: [count, tokens, max_rank]."""
        rows = self._h_rows(turn, tokens).view(tokens, *self._h_dims[1:])
        return rows[:, :count].permute(1, 0, 2)

    def add_lora(self, layer: int, module: ModuleSlices, x: torch.Tensor,
                 y: torch.Tensor) -> None:
        """y += x @ A.T @ Bt for every token of the step with an adapter.
        Launches the kernels whenever the step has LoRA requests, whatever
        its contents, so a graph captured with warm-up adapters replays them.

        Invariant: a shrink is told its h is zero only when the shrink before
        it, in this forward, zeroed that buffer's rows for as many tokens. A
        forward starts at `set_tokens`, or where (layer, first slice) does
        not grow: the host does not see a graph's replays, so nothing zeroed
        in another forward is trusted."""
        if not self.active or self.pages is None:
            return
        call = (layer, module.first)
        if call <= self._last_call:  # a new forward
            self._h_turn, self._h_zeroed = 0, None
        self._last_call = call
        tokens = x.shape[0]
        pool = self.pages[layer]
        graph = capturing(x)
        if graph:
            self._largest_graph = max(self._largest_graph, x.shape[0])
        if self.gate is not None:
            self.gate.before_layer(layer, x)
        # The batchings hold disjoint tokens. Each expand runs before the next
        # shrink (on the same stream), which zeroes the buffer that expand read.
        for batch in self._batches_for(tokens, graph):
            if batch.num_blocks == 0 and not graph:
                continue  # eager: nothing to do (a graph keeps every launch)
            turn = self._h_turn
            h = self.h_view(turn, module.count, tokens)
            self.backend.shrink(x, pool, h, batch, self.table, module, self.layout,
                                h_zeroed=self._h_zeroed == tokens,
                                zero_next=self._h_rows(1 - turn, tokens))
            self._h_turn, self._h_zeroed = 1 - turn, tokens
            self.backend.expand(h, pool, y, batch, self.table, module, self.layout)
        if self.gate is not None:
            self.gate.after_layer(layer, module, x, y)
