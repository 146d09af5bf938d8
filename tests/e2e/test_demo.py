"""README command 1 (`loraserve demo`) runs and says what it served, and
the `vllm serve` line it prints starts the same server when pasted."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from vllm_loraserve.process import SERVE_ENV, Server

pytestmark = pytest.mark.e2e
# A fresh machine's environment names none of what the demo's server needs
# (tests/conftest.py sets one of them for the whole suite).
FRESH_ENV = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}


def test_demo_serves_every_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_loraserve.cli.main", "demo", "--workdir", str(tmp_path),
         "--requests", "30"], capture_output=True, text=True, timeout=600, env=FRESH_ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "30/30 requests answered" in proc.stdout
    assert "25 adapters of ranks [8, 16, 32, 64, 128]" in proc.stdout
    assert "stopped (exit code 0)" in proc.stdout

    line = next(x.removeprefix("$ ") for x in proc.stdout.splitlines() if x.startswith("$ "))
    words = shlex.split(line)
    serve = words.index("serve")
    assert dict(w.split("=", 1) for w in words[:serve - 1]) == SERVE_ENV
    # Pasted into a shell that has none of SERVE_ENV, it serves (`env -u`
    # takes them out of what Server would add; bash execs the line's command).
    unset = [arg for k in SERVE_ENV for arg in ("-u", k)]
    pasted = Server(["env", *unset, "bash", "-c", line], str(tmp_path / "pasted.log"))
    try:
        port = re.search(r"--port (\d+)", line).group(1)
        pasted.wait_ready(f"http://127.0.0.1:{port}", 300, progress=False)
    finally:
        pasted.stop()
