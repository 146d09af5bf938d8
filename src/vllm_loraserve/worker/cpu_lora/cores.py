"""Which cores the CPU workers of one engine worker take.

The rule for the default (CpuPoolConfig.workers = 0): vLLM keeps, per
engine, one busy core for the API server, one for the engine core's loop,
and per GPU worker process one for the thread that launches kernels plus
one per host-tier reader thread (`--loraserve-read-threads`). Those are the
lowest-numbered cores of the process's affinity set; what remains is split
evenly between the node's GPU workers (local ranks), each taking its own
slice, at most MAX_DEFAULT workers (Toppings measured up to 16). When
nothing remains, one worker shares the last core with vLLM: cpu-assist then
runs but cannot pay, and the pool says so at start-up.

An explicit count takes the rank's spare slice too, and cores are reused
round-robin when it asks for more workers than the slice holds.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

MAX_DEFAULT = 16


def reserved_for_vllm(gpu_workers: int, read_threads: int) -> int:
    return 2 + gpu_workers * (1 + read_threads)


def assist_cores(requested: int, gpu_workers: int = 1, local_rank: int = 0,
                 read_threads: int = 4, available: Sequence[int] | None = None) -> list[int]:
    """One core per worker (repeats when cores are short), for `requested`
    workers, or the default count when `requested` is 0."""
    if requested < 0 or gpu_workers < 1 or not 0 <= local_rank < gpu_workers:
        raise ValueError(f"requested={requested}, gpu_workers={gpu_workers}, "
                         f"local_rank={local_rank}")
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    spare = cores[reserved_for_vllm(gpu_workers, read_threads):]
    each = len(spare) // gpu_workers
    mine = spare[local_rank * each:(local_rank + 1) * each] or [cores[-1 - local_rank % len(cores)]]
    count = requested or min(len(mine), MAX_DEFAULT)
    return [mine[i % len(mine)] for i in range(count)]


def shares_vllm_cores(cores: Sequence[int], gpu_workers: int, read_threads: int,
                      available: Sequence[int] | None = None) -> bool:
    """Whether any of `cores` is among those the rule leaves to vLLM, or taken twice."""
    ordered = sorted(os.sched_getaffinity(0) if available is None else available)
    kept = set(ordered[:reserved_for_vllm(gpu_workers, read_threads)])
    return bool(kept & set(cores)) or len(set(cores)) < len(cores)
