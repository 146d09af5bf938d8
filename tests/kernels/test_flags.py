"""The layer-group flag kernels (kernels/triton_flags.py), interpreted on CPU."""

from __future__ import annotations

import torch

from vllm_loraserve.kernels import triton_flags


def test_signal_raises_a_flag_to_the_epoch_and_wait_passes_only_then():
    flags = torch.tensor([0, 5, 2], dtype=torch.int64)
    epoch = torch.tensor([3], dtype=torch.int64)
    timeouts = torch.zeros(1, dtype=torch.int32)
    triton_flags.wait(flags, epoch, timeouts, 1, 4)  # flag 5 >= epoch 3: no wait
    assert int(timeouts[0]) == 0
    triton_flags.wait(flags, epoch, timeouts, 2, 4)  # flag 2 < 3: gives up, counted
    assert int(timeouts[0]) == 1
    triton_flags.signal(flags, epoch, 2)
    triton_flags.signal(flags, epoch, 1)  # never lowers a flag
    assert flags.tolist() == [0, 5, 3]
    triton_flags.wait(flags, epoch, timeouts, 2, 4)
    assert int(timeouts[0]) == 1
