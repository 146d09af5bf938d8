"""Demand estimation: converges, follows trends, smooths Poisson noise."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_loraserve.cluster.demand import DemandTracker


def _feed(tracker, rates, window=10.0):
    for rate in rates:
        tracker.record("a", int(rate * window))
        tracker.roll()


def test_constant_demand_is_estimated_exactly():
    t = DemandTracker(10.0)
    _feed(t, [100.0] * 6)
    assert t.estimate()["a"] == pytest.approx(100.0)
    assert t.last_window() == {"a": pytest.approx(100.0)}


def test_a_window_of_another_length_is_divided_by_its_real_length():
    t = DemandTracker(10.0)
    t.record("a", 50)
    t.roll(elapsed_s=2.5)  # e.g. a rebalance asked for early
    assert t.last_window() == {"a": pytest.approx(20.0)}


def test_linear_ramp_is_followed():
    t = DemandTracker(10.0)
    _feed(t, [10.0 * i for i in range(1, 30)])
    # next window's true rate is 300; the trend keeps the estimate close
    assert t.estimate()["a"] == pytest.approx(300.0, rel=0.05)


def test_silence_decays_to_zero_and_never_goes_negative():
    t = DemandTracker(10.0)
    _feed(t, [100.0] * 3 + [0.0] * 12)
    assert 0.0 <= t.estimate()["a"] < 5.0


def test_noise_is_smoothed_compared_to_one_window():
    rng = np.random.default_rng(0)
    t = DemandTracker(10.0)
    estimates, raw = [], []
    for _ in range(400):
        count = rng.poisson(15)  # ~15 requests of 100 tokens per window
        t.record("a", count * 100)
        t.roll()
        estimates.append(t.estimate()["a"])
        raw.append(count * 100 / 10.0)
    est, raw = np.array(estimates[20:]), np.array(raw[20:])
    assert est.mean() == pytest.approx(150.0, rel=0.05)
    assert est.std() < 0.8 * raw.std()
