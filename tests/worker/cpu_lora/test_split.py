"""Rows per worker from the start-up profile (Toppings' profiling-guided
parallelism) and the profile itself."""

from __future__ import annotations

import pytest

from vllm_loraserve.worker.cpu_lora.split import profile_rows_per_s, split_rows


def _sizes(ranges):
    return [end - start for start, end in ranges]


def test_rows_follow_the_speeds_and_cover_the_job_in_order():
    ranges = split_rows(1000, [1.0, 3.0], min_rows=16)
    assert ranges == [(0, 250), (250, 1000)]
    ranges = split_rows(7, [1.0, 1.0, 1.0], min_rows=1)
    assert sum(_sizes(ranges)) == 7 and max(_sizes(ranges)) - min(_sizes(ranges)) <= 1
    for n in (0, 1, 5, 16, 17, 100, 2048, 2049):
        ranges = split_rows(n, [2.0, 1.0, 1.5, 0.5], min_rows=16)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(end >= start for start, end in ranges)


def test_small_jobs_use_only_the_fastest_workers():
    # 40 rows at min_rows 16: two workers, the two fastest (1 and 2).
    ranges = split_rows(40, [1.0, 4.0, 2.0, 0.5], min_rows=16)
    sizes = _sizes(ranges)
    assert sizes[0] == 0 and sizes[3] == 0 and sum(sizes) == 40
    assert sizes[1] > sizes[2] > 0
    # Fewer rows than min_rows: one worker (the fastest) takes them all.
    assert _sizes(split_rows(5, [1.0, 2.0], min_rows=16)) == [0, 5]


def test_bad_inputs_are_refused():
    for n, speeds, min_rows in ((-1, [1.0], 1), (4, [], 1), (4, [0.0], 1), (4, [1.0], 0)):
        with pytest.raises(ValueError):
            split_rows(n, speeds, min_rows)


def test_the_profile_measures_a_positive_rate():
    assert profile_rows_per_s(0.01) > 0
