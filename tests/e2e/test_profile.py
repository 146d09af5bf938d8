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
    # More prompt tokens take longer: 16 against 256 (at 16 against 64 the
    # slope was within a 2-core machine's timing noise, and the fit gave 0).
    assert profile.step.coef["prefill_tokens"] > 0
    assert set(profile.operating_points) == {8, 32}
    assert all(v > 0 for v in profile.operating_points.values())
    assert {"all_steps", "decode_mbgmv", "prefill_mbgmv"} <= set(profile.fit_r2)
    assert "plugin vLLM" in profile.source
    samples = json.loads((tmp_path / "profile.samples.json").read_text())
    # 2 batch sizes x 3 mixes (r8, r32, mixed): a decode point and 2 prefill points each
    assert len(samples) == 2 * 3 * 3
    assert all(s["seconds"] > 0 for s in samples)
