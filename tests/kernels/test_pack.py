"""One launch packs a load (kernels/triton_pack.py) as pack_layers does,
from the file's bytes and the reader's pack table, under Triton's
interpreter. The interpreter rounds fp32 to bf16 toward zero, where torch
and a GPU round to nearest (tests/gpu/test_load_sync_gpu.py checks bit for
bit), so where bf16 is involved values may differ by one unit in the last
place here; elsewhere they are equal."""

from __future__ import annotations

import pytest
import torch

from vllm_loraserve.adapters.peft import RawTensor
from vllm_loraserve.kernels.triton_pack import pack_streams
from vllm_loraserve.paging.layout import LayerLayout, SliceSpec, pack_layers, pack_table

SLICES = (SliceSpec("q_proj", 40, 48), SliceSpec("k_proj", 40, 24),
          SliceSpec("down_proj", 72, 40))


def _file(layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], pad: int = 0
          ) -> tuple[torch.Tensor, list[dict[str, tuple[RawTensor, RawTensor]]]]:
    """The tensors as a file's data holds them (one byte buffer, `pad` bytes
    before each) and where each lies."""
    chunks, where, at = [], [], 0
    for w in layers:
        where.append({})
        for name, ab in w.items():
            raw = []
            for t in ab:
                at += pad
                chunks += [torch.zeros(pad, dtype=torch.uint8),
                           t.contiguous().view(-1).view(torch.uint8)]
                raw.append(RawTensor(at, tuple(t.shape), t.dtype))
                at += t.numel() * t.element_size()
            where[-1][name] = tuple(raw)
    return torch.cat(chunks), where


def _adapter(rank, file_dtype, lacking=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{s.name: (torch.randn(rank, s.in_features, generator=g).to(file_dtype),
                      torch.randn(s.out_features, rank, generator=g).to(file_dtype))
             for s in SLICES if (la, s.name) not in lacking} for la in range(3)]


def _close(got, want, exact):
    """Exact, or within one bf16 unit in the last place where bf16 is the
    file's or the stream's dtype (the interpreter's rounding to bf16)."""
    if exact:
        assert torch.equal(got, want)
        return
    assert torch.equal(got == 0, want == 0)
    assert ((got.float() - want.float()).abs() <= want.float().abs() / 128).all()


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("file_dtype, out_dtype", [
    (BF16, BF16), (FP32, BF16), (FP16, FP16), (FP32, FP32), (FP16, FP32), (FP32, FP16),
    (BF16, FP16), (FP16, BF16), (BF16, FP32)])
@pytest.mark.parametrize("rank", [5, 16, 33])
def test_one_launch_packs_as_pack_layers(file_dtype, out_dtype, rank):
    """Bt = scaling * B^T rounds as torch rounds it: to the file's dtype,
    then to the stream's (an fp16 file into fp32 streams shows it exactly)."""
    layout = LayerLayout(SLICES, page_size=512, align=32)  # panels of 32 columns
    layers = _adapter(rank, file_dtype, lacking={(1, "k_proj")})
    data, where = _file(layers)
    placement = layout.place(rank, [s.name for s in SLICES])
    want = pack_layers(layout, placement, layers, 0.3, out_dtype)
    table = pack_table(layout, placement, where)
    got = torch.zeros_like(want)
    pack_streams(data.view(file_dtype), torch.from_numpy(table), got, rank, 0.3,
                 max(max(s.in_features, s.out_features) for s in SLICES), layout.panel)
    exact = BF16 not in (file_dtype, out_dtype)
    _close(got, want, exact)
    sub = torch.zeros_like(want[1:])  # a layer group's streams: layers 1 and 2
    pack_streams(data.view(file_dtype), torch.from_numpy(table), sub, rank, 0.3, 72,
                 layout.panel, range(1, 3))
    _close(sub, want[1:], exact)


def test_tables_it_cannot_pack_in_one_launch():
    layout = LayerLayout(SLICES, page_size=512, align=32)
    placement = layout.place(4, [s.name for s in SLICES])
    mixed = _adapter(4, torch.bfloat16)
    mixed[2]["q_proj"] = tuple(t.float() for t in mixed[2]["q_proj"])
    assert pack_table(layout, placement, _file(mixed)[1]) is None  # two dtypes
    odd = _file(_adapter(4, torch.float32), pad=2)[1]  # offsets not whole fp32 elements
    assert pack_table(layout, placement, odd) is None
    bad = _adapter(4, torch.bfloat16)
    bad[0]["q_proj"] = (bad[0]["q_proj"][0][:3], bad[0]["q_proj"][1])
    with pytest.raises(ValueError, match="do not match rank 4"):
        pack_table(layout, placement, _file(bad)[1])


def test_the_table_points_at_the_files_bytes():
    layout = LayerLayout(SLICES, page_size=512, align=32)
    layers = _adapter(8, torch.bfloat16)
    data, where = _file(layers, pad=4)  # whole bf16 elements apart
    table = pack_table(layout, layout.place(8, [s.name for s in SLICES]), where)
    flat = data.view(torch.bfloat16)
    assert len(table) == 3 * 2 * len(SLICES)
    for layer, src, cols, is_b, dst in table.tolist():
        g = next(g for g, s in enumerate(SLICES)
                 if dst == layout.place(8, [s.name for s in SLICES]).seg_offsets[2 * g + is_b])
        t = layers[layer][SLICES[g].name][is_b]
        assert cols == (SLICES[g].out_features if is_b else SLICES[g].in_features)
        assert torch.equal(flat[src:src + t.numel()].view(t.shape), t)
