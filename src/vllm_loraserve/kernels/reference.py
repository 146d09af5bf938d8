"""Torch reference of the paged LoRA kernels (same interface as the Triton
backend). The tests hold the kernels to it, and the engine's CPU path runs it.

Per slot, it reads each needed segment back to a dense matrix
(paging/layout.read_segment) and multiplies in fp32; the weight gradients go
back into pages through `add_to_segment`, read_segment's transpose.
"""

from __future__ import annotations

import torch

from vllm_loraserve.kernels.batch import ModuleSlices, SlotTable, TokenBatch
from vllm_loraserve.paging.layout import LayerLayout, add_to_segment, read_segment


def _slot_groups(batch: TokenBatch, slots: SlotTable):
    """(slot, rank, segment offsets, token indices) per slot in the batch;
    table rows are read once per call (element reads of a tensor are slow)."""
    sorted_tokens = batch.sorted_tokens.long()
    groups: dict[int, list[tuple[int, int]]] = {}
    for slot, start, length in batch.blocks[:batch.num_blocks].tolist():
        groups.setdefault(slot, []).append((start, length))
    ids = list(groups)
    ranks, segs = slots.rank[ids].tolist(), slots.seg_offsets[ids].tolist()
    for slot, rank, seg, spans in zip(ids, ranks, segs, groups.values(), strict=True):
        yield slot, rank, seg, torch.cat([sorted_tokens[s:s + n] for s, n in spans])


class TorchBackend:
    name = "torch"

    def warm_up(self, *args: object) -> int:
        return 0  # nothing is compiled

    def page_writer(self, pages: list[torch.Tensor]):
        """Writes a load's pages layer by layer (see the package docstring)."""
        def write(page_ids: torch.Tensor, streams: torch.Tensor) -> None:
            ids = page_ids.long()
            for layer, dst in enumerate(pages):
                dst.index_copy_(0, ids, streams[layer].view(-1, dst.shape[1]).to(dst.dtype))
        return write

    def shrink(self, x: torch.Tensor, pool: torch.Tensor, h: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout,
               h_zeroed: bool = False, zero_next: torch.Tensor | None = None) -> None:
        """h[s, t, :rank] = x[t] @ A_{slot(t), s}.T; every other entry of h is 0
        (zeroed here whatever `h_zeroed` says), and so is `zero_next`."""
        pages2d = pool.view(-1, layout.page_size)
        h.zero_()
        if zero_next is not None:
            zero_next.zero_()
        for slot, rank, offsets, toks in _slot_groups(batch, slots):
            for s in range(module.count):
                seg = 2 * (module.first + s)
                off = offsets[seg]
                if off < 0:
                    continue
                a = read_segment(layout, pages2d, slots.pages[slot], rank, off, seg)
                h[s, toks, :rank] = x[toks].float() @ a.float().T

    def expand(self, h: torch.Tensor, pool: torch.Tensor, y: torch.Tensor, batch: TokenBatch,
               slots: SlotTable, module: ModuleSlices, layout: LayerLayout) -> None:
        """y[t, slice s columns] += h[s, t, :rank] @ Bt_{slot(t), s}; tokens
        without an adapter and untargeted slices are left as they are."""
        pages2d = pool.view(-1, layout.page_size)
        for slot, rank, offsets, toks in _slot_groups(batch, slots):
            for s, (col, n_out) in enumerate(zip(module.out_offsets, module.out_features,
                                                 strict=True)):
                seg = 2 * (module.first + s) + 1
                off = offsets[seg]
                if off < 0:
                    continue
                bt = read_segment(layout, pages2d, slots.pages[slot], rank, off, seg)
                delta = h[s, toks, :rank].float() @ bt.float()
                y[toks, col:col + n_out] += delta.to(y.dtype)

    def expand_grad_h(self, dy: torch.Tensor, pool: torch.Tensor, dh: torch.Tensor,
                      batch: TokenBatch, slots: SlotTable, module: ModuleSlices,
                      layout: LayerLayout) -> None:
        """dh[s, t, :rank] = dy[t, slice s columns] @ Bt_{slot(t), s}.T; every
        other entry of dh is 0 (the input gradient of `expand`)."""
        pages2d = pool.view(-1, layout.page_size)
        dh.zero_()
        for slot, rank, offsets, toks in _slot_groups(batch, slots):
            for s, (col, n_out) in enumerate(zip(module.out_offsets, module.out_features,
                                                 strict=True)):
                seg = 2 * (module.first + s) + 1
                if offsets[seg] < 0:
                    continue
                bt = read_segment(layout, pages2d, slots.pages[slot], rank, offsets[seg], seg)
                dh[s, toks, :rank] = dy[toks, col:col + n_out].float() @ bt.float().T

    def shrink_grad_x(self, dh: torch.Tensor, pool: torch.Tensor, dx: torch.Tensor,
                      batch: TokenBatch, slots: SlotTable, module: ModuleSlices,
                      layout: LayerLayout) -> None:
        """dx[t] += sum over slices s of dh[s, t, :rank] @ A_{slot(t), s} (the
        input gradient of `shrink`); tokens without an adapter are left as
        they are."""
        pages2d = pool.view(-1, layout.page_size)
        for slot, rank, offsets, toks in _slot_groups(batch, slots):
            for s in range(module.count):
                seg = 2 * (module.first + s)
                if offsets[seg] < 0:
                    continue
                a = read_segment(layout, pages2d, slots.pages[slot], rank, offsets[seg], seg)
                dx[toks] += (dh[s, toks, :rank].float() @ a.float()).to(dx.dtype)

    def grad_pool(self, x: torch.Tensor, h: torch.Tensor, dy: torch.Tensor, dh: torch.Tensor,
                  dpool: torch.Tensor, batch: TokenBatch, slots: SlotTable,
                  module: ModuleSlices, layout: LayerLayout) -> None:
        """The weight gradients, added into `dpool` (laid out as the pool):
        A_{slot, s} += dh[s, toks, :rank].T @ x[toks] and Bt_{slot, s} +=
        h[s, toks, :rank].T @ dy[toks, slice s columns], over each slot's
        tokens in `batch`. Each slot costs its own rank."""
        pages2d = dpool.view(-1, layout.page_size)
        for slot, rank, offsets, toks in _slot_groups(batch, slots):
            for s, (col, n_out) in enumerate(zip(module.out_offsets, module.out_features,
                                                 strict=True)):
                g = module.first + s
                if offsets[2 * g] < 0:
                    continue
                grads = (dh[s, toks, :rank].T @ x[toks].float(),
                         h[s, toks, :rank].T @ dy[toks, col:col + n_out].float())
                for seg, rows in zip((2 * g, 2 * g + 1), grads, strict=True):
                    add_to_segment(layout, pages2d, slots.pages[slot], offsets[seg], seg, rows)
