"""kernels/launch.py: the key that picks a compiled variant for a direct launch."""

from __future__ import annotations

import torch

from vllm_loraserve.kernels.launch import _key


def test_key_separates_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert _key(base) == _key(torch.zeros(8, dtype=torch.bfloat16))
    assert _key(base) != _key(base[1:])  # 2 bytes in: not 16-byte aligned
    assert _key(base) != _key(base.float())
    keys = {n: _key(n) for n in (0, 1, 16, 32, 17, 2 ** 31, 2 ** 63)}
    assert keys[16] == keys[32]
    assert len({keys[0], keys[1], keys[16], keys[17], keys[2 ** 31], keys[2 ** 63]}) == 6
    assert _key(True) != _key(1) and _key(False) != _key(0)  # Triton: u1, not an int


def test_hooks_count_only_when_set(monkeypatch):
    """Newer Triton keeps empty hook chains by default: those are no hook."""
    from vllm_loraserve.kernels import launch

    rt = launch._knobs.runtime
    assert not launch._hooked()
    monkeypatch.setattr(rt, "launch_enter_hook", lambda *a: None)
    assert launch._hooked()
