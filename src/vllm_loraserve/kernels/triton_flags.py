"""Device-side flags for pipelined page loads: a signal and a spin-wait.

A pipelined load (worker/cold_start.py) writes an adapter's pages layer
group by layer group on a side stream; each layer of the forward pass, on
the main stream, must not read its group's pages before they are written.
A host-side `wait_event` would be recorded once when vLLM captures a CUDA
graph and replayed against that capture's event, so the wait lives on the
device instead, over persistent tensors whose addresses a graph keeps:

- `flags[g]` (int64): the epoch at which group g's pages were last written;
- `epoch[0]` (int64): the epoch of the step now running, written by the
  host before the step's forward pass (a graph replay reads the new one).

`signal` (side stream, after group g's page writes) raises flags[g] to the
epoch; `wait` (main stream, before a layer's shrink) spins in one program
until flags[g] >= epoch. The wait spins at most `max_spins` polls, then
counts a timeout in `timeouts[0]` and returns: a wait that never ends would
hang the device with no message, while the count is an error the host
reports (worker/group_flags.py). Loads are volatile (not cached in L1), and
the signal is an atomic, so it lands in L2 where the spinning program reads.

Under TRITON_INTERPRET=1 both run on CPU tensors (tests/kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["group"])
def _signal_kernel(flags_ptr, epoch_ptr, group):
    tl.atomic_max(flags_ptr + group, tl.load(epoch_ptr))


@triton.jit(do_not_specialize=["group", "max_spins"])
def _wait_kernel(flags_ptr, epoch_ptr, timeouts_ptr, group, max_spins):
    target = tl.load(epoch_ptr)
    flag = tl.load(flags_ptr + group, volatile=True)
    spins = 0
    while (flag < target) & (spins < max_spins):
        flag = tl.load(flags_ptr + group, volatile=True)
        spins += 1
    if flag < target:
        tl.atomic_add(timeouts_ptr, 1)


def signal(flags: torch.Tensor, epoch: torch.Tensor, group: int) -> None:
    """flags[group] = max(flags[group], epoch[0]), on the current stream."""
    _signal_kernel[(1,)](flags, epoch, group)


def wait(flags: torch.Tensor, epoch: torch.Tensor, timeouts: torch.Tensor, group: int,
         max_spins: int) -> None:
    """Spin (one program, on the current stream) until flags[group] >=
    epoch[0], or count a timeout after `max_spins` polls."""
    _wait_kernel[(1,)](flags, epoch, timeouts, group, max_spins)
