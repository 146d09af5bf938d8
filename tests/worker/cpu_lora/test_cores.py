"""Which cores the CPU workers take: the default's rule (cores.py)."""

from __future__ import annotations

import pytest

from vllm_loraserve.worker.cpu_lora.cores import (
    MAX_DEFAULT,
    assist_cores,
    reserved_for_vllm,
    shares_vllm_cores,
)

CORES_64 = list(range(64))


def test_default_takes_what_vllm_leaves_split_between_gpu_workers():
    # 2 + 1 * (1 + 4) = 7 cores stay with vLLM; 57 spare, capped at 16.
    assert reserved_for_vllm(1, 4) == 7
    assert assist_cores(0, 1, 0, 4, CORES_64) == list(range(7, 7 + MAX_DEFAULT))
    # 8 GPU workers, 1 reader each: 2 + 8 * 2 = 18 kept, 46 spare, 5 each.
    per_rank = [assist_cores(0, 8, rank, 1, CORES_64) for rank in range(8)]
    assert all(len(cores) == 5 for cores in per_rank)
    flat = [c for cores in per_rank for c in cores]
    assert len(set(flat)) == len(flat) and min(flat) == 18
    assert not any(shares_vllm_cores(c, 8, 1, CORES_64) for c in per_rank)


def test_no_spare_core_means_one_worker_sharing_with_vllm():
    cores = assist_cores(0, 1, 0, 4, [0, 1])
    assert cores == [1]
    assert shares_vllm_cores(cores, 1, 4, [0, 1])


def test_an_explicit_count_reuses_cores_round_robin():
    assert assist_cores(3, 1, 0, 4, list(range(9))) == [7, 8, 7]
    assert shares_vllm_cores([7, 8, 7], 1, 4, list(range(9)))  # core 7 twice
    assert assist_cores(4, 1, 0, 0, list(range(16))) == [3, 4, 5, 6]


def test_bad_arguments_are_refused():
    for args in ((-1, 1, 0), (1, 0, 0), (1, 2, 2)):
        with pytest.raises(ValueError):
            assist_cores(*args, available=CORES_64)
