"""The CPU LoRA op fix: tokens mapped to -1 (no adapter) stay untouched.

vLLM's own ops are the reference for rows that have an adapter; the first
test pins the upstream bug this fix exists for (vllm#48421), so it fails
once vLLM fixes it and the patch can go.
"""

from __future__ import annotations

import pytest
import torch

from vllm_loraserve._patching import original
from vllm_loraserve.worker import cpu_ops


@pytest.fixture(scope="module")
def ops():
    from vllm.lora.ops.torch_ops import lora_ops

    stock = {n: original(getattr(lora_ops, n)) for n in cpu_ops._BGMV_OPS}
    fixed = {n: cpu_ops._adapter_rows_only(f) for n, f in stock.items()}
    return stock, fixed


SLOTS, T, D_IN, R, D_OUT = 3, 7, 16, 4, 12
IDX = torch.tensor([0, -1, 2, 2, -1, 1, 0])


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D_IN, generator=g), torch.randn(SLOTS, 1, R, D_IN, generator=g),
            torch.randn(T, R, generator=g), torch.randn(SLOTS, 1, D_OUT, R, generator=g))


def test_stock_op_applies_last_slot_to_tokens_without_adapter(ops):
    stock, _ = ops
    x, a, _, _ = _data()
    out = torch.zeros(T, R)
    stock["bgmv_shrink"](x, a, out, IDX, 1.0)
    assert torch.allclose(out[1], x[1] @ a[-1, 0].T)  # -1 read as the last slot


def test_shrink(ops):
    stock, fixed = ops
    x, a, _, _ = _data()
    ref, out = torch.zeros(T, R), torch.full((T, R), 7.0)
    stock["bgmv_shrink"](x, a, ref, IDX, 0.5)
    fixed["bgmv_shrink"](x, a, out, IDX, 0.5)
    keep = IDX >= 0
    assert torch.equal(out[keep], ref[keep])
    assert torch.all(out[~keep] == 7.0)
    for t in range(T):
        if IDX[t] >= 0:
            assert torch.allclose(out[t], 0.5 * a[IDX[t], 0] @ x[t], atol=1e-5)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand(ops, add_inputs):
    stock, fixed = ops
    _, _, h, b = _data(1)
    y0 = torch.randn(T, D_OUT)
    ref, out = y0.clone(), y0.clone()
    stock["bgmv_expand"](h, b, ref, IDX, add_inputs)
    fixed["bgmv_expand"](h, b, out, IDX, add_inputs)
    keep = IDX >= 0
    assert torch.equal(out[keep], ref[keep])
    assert torch.equal(out[~keep], y0[~keep])


def test_expand_slice(ops):
    stock, fixed = ops
    _, _, h, b = _data(2)
    y0 = torch.randn(T, 3 * D_OUT)
    ref, out = y0.clone(), y0.clone()
    stock["bgmv_expand_slice"](h, b, ref, IDX, D_OUT, D_OUT, True)
    fixed["bgmv_expand_slice"](h, b, out, IDX, D_OUT, D_OUT, True)
    keep = IDX >= 0
    assert torch.equal(out[keep], ref[keep]) and torch.equal(out[~keep], y0[~keep])


def test_all_rows_without_adapter_is_a_no_op(ops):
    _, fixed = ops
    x, a, _, _ = _data()
    out = torch.full((T, R), 3.0)
    fixed["bgmv_shrink"](x, a, out, torch.full((T,), -1), 1.0)
    assert torch.all(out == 3.0)


def test_install_patches_sgmv_path_and_punica_cpu():
    """sgmv_* (prefill) reach the fixed bgmv through lora_ops' globals."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_ops.install()
    cpu_ops.install()  # idempotent
    for name in cpu_ops._BGMV_OPS:
        wrapped = [getattr(lora_ops, name), getattr(punica_cpu, name)]
        stock = original(wrapped[0])
        assert all(f is not stock and original(f) is stock for f in wrapped)
        assert original(stock) is stock  # wrapped once, not twice
    x, a, _, _ = _data()
    out = torch.full((T, R), 5.0)
    lora_ops.sgmv_shrink(x, a, out, None, torch.tensor([3, 4]), torch.tensor([-1, 0]),
                         2, 4, T, 1.0)
    assert torch.all(out[:3] == 5.0)
    assert torch.allclose(out[3:], x[3:] @ a[0, 0].T, atol=1e-5)
