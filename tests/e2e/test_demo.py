"""README command 1 (`loraserve demo`) runs and says what it served."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_serves_every_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_loraserve.cli.main", "demo", "--workdir", str(tmp_path),
         "--requests", "30"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "30/30 requests answered" in proc.stdout
    assert "25 adapters of ranks [8, 16, 32, 64, 128]" in proc.stdout
    assert "stopped (exit code 0)" in proc.stdout
