"""Per layer group: are this step's pipelined page writes of that group done?

Epochs (kernels/triton_flags.py has the device side): the host bumps the
epoch, on the main stream, before a step whose loads are pipelined; group
g counts as written once `flags[g] >= epoch`. A step without such loads
leaves the epoch alone, so every flag is already >= it and no layer waits.
A layer of a step whose loads are pipelined waits until the side stream
(or, on the CPU, the load lane: worker/load_lane.py) has signalled its own
group.

Two ways to run them: the Triton kernels (always on a GPU, whatever the
LoRA kernels are: a wait must be a launch that a CUDA graph can hold; on
the CPU under TRITON_INTERPRET=1 with the triton LoRA backend), or torch on
the host in program order (the CPU engine), where a wait whose group is not
signalled yet cannot be waited out: it raises, since a layer would read
pages that were never written.
"""

from __future__ import annotations

import torch

# Polls before a device-side wait gives up and counts a timeout: seconds on
# an H100-class GPU (a poll is one uncached load), far beyond any page load.
MAX_SPINS = 1 << 25


class FlagTimeout(RuntimeError):
    """A layer waited past MAX_SPINS for its group's pages: its outputs read
    pages that were not written (a bug, never a slow load)."""


class GroupFlags:
    def __init__(self, num_groups: int, device: torch.device, triton: bool,
                 max_spins: int = MAX_SPINS) -> None:
        if torch.device(device).type == "cuda" and not triton:
            raise ValueError("on a GPU, layer-group waits are Triton kernels")
        self.triton = triton
        self.max_spins = max_spins
        self.flags = torch.zeros(num_groups, dtype=torch.int64, device=device)
        self.epoch_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.timeouts = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = 0
        self.waits = 0  # waits launched (on a GPU: not counting graph replays)
        cuda = torch.device(device).type == "cuda"
        # The timeouts count, copied to the host without a wait: read once copied.
        self._seen = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._copied: torch.cuda.Event | None = None
        self._cuda = cuda

    def warm_up(self) -> None:
        """Compile both kernels before serving (nothing waits at epoch 0)."""
        self.signal(0)
        self.wait(0)
        self.waits = 0

    def advance(self) -> None:
        """A new epoch, on the current stream: every group is unwritten
        until signalled."""
        self.epoch += 1
        self.epoch_dev.fill_(self.epoch)

    def signal(self, group: int) -> None:
        """Group `group` is written, after the work queued so far on the
        current stream."""
        if self.triton:
            from vllm_loraserve.kernels import triton_flags

            triton_flags.signal(self.flags, self.epoch_dev, group)
        else:
            g = self.flags[group:group + 1]
            torch.maximum(g, self.epoch_dev, out=g)

    def wait(self, group: int) -> None:
        """The current stream goes on once group `group` is written."""
        self.waits += 1
        if self.triton:
            from vllm_loraserve.kernels import triton_flags

            triton_flags.wait(self.flags, self.epoch_dev, self.timeouts, group, self.max_spins)
        elif int(self.flags[group]) < int(self.epoch_dev[0]):
            self.timeouts += 1
            raise FlagTimeout(f"layer group {group} is read before its pages were written "
                              f"(flag {int(self.flags[group])}, epoch {self.epoch})")

    def check(self) -> None:
        """Raise FlagTimeout if a wait timed out (on a GPU: as of a copy made
        at an earlier check that has landed since; no host wait)."""
        if not self._cuda:
            count = int(self.timeouts[0])
        else:
            count = 0
            if self._copied is not None and self._copied.query():
                count, self._copied = int(self._seen[0]), None
            if self._copied is None:
                self._seen.copy_(self.timeouts, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record()
        if count:
            raise FlagTimeout(f"{count} layer wait(s) for pipelined page writes timed out "
                              f"after {self.max_spins} polls: those layers read pages that "
                              "were not written")
