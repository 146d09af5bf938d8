"""The CPU half of `--loraserve-cold-start cpu-assist`: one LoRA delta.

While a cold adapter's pages are still being written, the layers whose
pages have not landed get that adapter's delta from here (Toppings §4):

    y = ((x @ a.T) * scaling) @ bt        (fp32 math, [n, out])

x: the cold adapter's rows of the layer input, on the CPU; a [r, in] and bt
[r, out] (B transposed, unscaled), read in place from the host tier's copy
of the weights file (worker/host_tier.py; any strides). The caller
(worker/cold_start.py) copies x down and the result up, and adds it.

`CpuAssist` is plain torch on the engine's CPU threads
(--loraserve-cpu-assist-workers -1, and after the workers failed), called
synchronously from the layer: copying x to the host waits for the device
to reach that layer. worker/cpu_lora/pool.py's `CpuWorkerPool` keeps the
same `delta` (used where the csrc/ op is missing on a GPU); by default
cold_start.py uses its sync-free `enqueue` instead.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Delta(Protocol):
    def delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: float,
              out_dtype: torch.dtype = torch.float32,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """((x @ a.T) * scaling) @ bt in fp32 for x [n, in] on the CPU, as an
        [n, out] tensor of `out_dtype`: `out` if given, else a new one."""


class CpuAssist:
    """`Delta` with torch on this process's CPU threads."""

    def delta(self, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: float,
              out_dtype: torch.dtype = torch.float32,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != a.shape[1] or x.device.type != "cpu" \
                or a.shape[0] != bt.shape[0]:
            raise ValueError(f"x {tuple(x.shape)} on {x.device}, a {tuple(a.shape)}, bt "
                             f"{tuple(bt.shape)}: not x [n, in] on the CPU, a [r, in], bt [r, out]")
        h = x.float() @ a.float().T
        h *= scaling
        y = h @ bt.float()
        if out is None:
            return y.to(out_dtype)
        if out.shape != y.shape or out.dtype != out_dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not {tuple(y.shape)} "
                             f"{out_dtype}")
        out.copy_(y)
        return out
