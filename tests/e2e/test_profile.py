"""`loraserve profile` against a real (CPU) engine: a usable profile file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from vllm_loraserve.perf.model import FEATURES, Profile

from .reference import IN_PROCESS

pytestmark = pytest.mark.e2e


def test_profile_cpu_engine(tiny_assets, tmp_path):
    adapters = tmp_path / "adapters"
    for name in ("adapter-000-r8", "adapter-002-r32"):
        shutil.copytree(os.path.join(tiny_assets, "adapters", name), adapters / name)
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_loraserve.cli.main", "profile", "--model",
         os.path.join(tiny_assets, "model"), "--adapter-dir", str(adapters), "--out", str(out),
         "--batch-sizes", "1", "4", "--prompt-lens", "16", "256", "--repeats", "1", "--plugin"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **IN_PROCESS})
    assert proc.returncode == 0, proc.stderr[-4000:]
    profile = Profile.load(out)
    assert set(profile.step.coef) == set(FEATURES)
    assert all(v >= 0 for v in profile.step.coef.values())
    # The fitted slopes are timings: on a shared 2-core CI machine even 16
    # against 256 prompt tokens fitted a prefill slope of 0 once. That the fit
    # recovers them is tested on synthetic samples (tests/perf/test_model.py);
    # here, that the engine's samples are what was asked for.
    assert set(profile.operating_points) == {8, 32}
    assert all(v > 0 for v in profile.operating_points.values())
    assert {"all_steps", "decode_mbgmv", "prefill_mbgmv"} <= set(profile.fit_r2)
    assert "plugin vLLM" in profile.source
    samples = json.loads((tmp_path / "profile.samples.json").read_text())
    # 2 batch sizes x 3 mixes (r8, r32, mixed): a decode point and 2 prefill points each
    assert len(samples) == 2 * 3 * 3
    prefill = [s for s in samples if s["prefill"]]
    assert {p[0] for s in prefill for p in s["prefill"]} == {16, 256}
    assert {len(s["prefill"]) for s in prefill} == {1, 4}  # the batch sizes
    # A prefill sample is a run's wall time; a decode one a difference of two
    # (clamped at 0 where noise made it negative).
    assert all(s["seconds"] > 0 for s in prefill)
    assert all(s["seconds"] >= 0 for s in samples)
