"""Launching a Triton kernel with little host time.

`kernel[grid](*args, **meta)` binds and specialises every argument in
Python before each launch: about 20 µs of host time on the GPU machines
(benchmarks/kernels/launch_cost.py). vLLM runs every step larger than its
largest CUDA graph (512 tokens by default) eagerly, and there the pool
launches two kernels per LoRA module and layer. On an H200 host the whole
`add_lora` took ~95 µs a module, 12 ms a step at Llama-3-8B all-linear,
and in the e2e run the GPU sat idle about a quarter of the time
(docs/benchmarks/e2e.md and kernels.md, session 19).

`Launcher` keeps, per specialisation of the runtime arguments, the compiled
variant that Triton's own launch returned, and launches it directly after
that. The specialisation is keyed conservatively: each tensor's dtype and
16-byte alignment; each integer's equality to 0 and 1, its divisibility by
16 and its width (32 bits, 64, unsigned 64); bools apart from integers.
Triton (3.3 and later, which launch every parameter, constexprs too) keys
its variants on a subset of these, so a key never maps to a variant
compiled for other arguments; at worst Triton is asked twice for the same
variant (from its cache). Triton's settings read at launch time (its debug
and instrumentation knobs, pre-run hooks) are those of each key's first
launch.

Invariant: launches go through `kernel[grid]` (compiling if needed) when the
tensors are not on CUDA (the Triton interpreter), when a Triton launch hook
is set (a profiler such as proton wants to see every launch; direct launches
pass none), and the first time a key is seen. So the first launch of every variant is Triton's own,
and a CUDA graph captures the same launch either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

try:
    from triton import knobs as _knobs
except ImportError:  # Triton before `knobs`: its launcher differs, no direct launches
    _knobs = None


def _key(a: Any) -> tuple:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return (bool, a)
    if isinstance(a, int):
        width = 32 if -(2 ** 31) <= a < 2 ** 31 else 64 if a < 2 ** 63 else 65
        return (a == 0, a == 1, a % 16 == 0, width)
    return (type(a), a)


def _hooked() -> bool:
    """Whether a launch hook is set: a callable (older Triton) or a
    non-empty `HookChain` (newer Triton, whose empty chains are the default)."""
    rt = getattr(_knobs, "runtime", None)
    if rt is None:
        return False
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Launcher:
    """One kernel at one grid and set of compile-time arguments (`meta`:
    constexprs and options such as num_warps), launched with runtime
    arguments only. The kernel's constexpr parameters must follow all its
    runtime ones (Triton's compiled launcher takes every parameter, in
    order)."""

    def __init__(self, kernel: triton.runtime.JITFunction, grid: Sequence[int],
                 meta: dict[str, Any]) -> None:
        self.kernel, self.meta = kernel, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self._compiled: dict[tuple, Any] = {}
        # The interpreter's kernels (TRITON_INTERPRET=1) have no parameter
        # list and nothing compiled: every launch is Triton's own there.
        params = getattr(kernel, "params", None)
        self._tail = None
        if params is not None and _knobs is not None:
            runtime = [p for p in params if not p.is_constexpr]
            if params[:len(runtime)] != runtime:
                raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must come last")
            self._tail = tuple(meta[p.name] for p in params[len(runtime):])

    def __call__(self, *args: Any) -> None:
        first = args[0]
        if self._tail is None or not (isinstance(first, torch.Tensor) and first.is_cuda) \
                or _hooked():
            self.kernel[self.grid](*args, **self.meta)
            return
        key = tuple(map(_key, args))
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.kernel[self.grid](*args, **self.meta)
            return
        stream = torch.cuda.current_stream().cuda_stream  # Triton's: the current device's
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *self._tail)
