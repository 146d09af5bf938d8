"""The CPU examples in examples/, run as a user would, on the demo's assets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_loraserve.process import SERVE_ENV

from .server import vllm_server

pytestmark = pytest.mark.e2e
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _run(*args: str) -> str:
    # as on a fresh machine: every example sets what it needs
    env = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_openai_client(tiny_assets, tmp_path):
    adapters = os.path.join(tiny_assets, "adapters")
    args = ["--plugin", "loraserve", "--max-lora-rank", "128", "--loraserve-adapter-dir", adapters,
            "--served-model-name", "tiny"]
    with vllm_server(os.path.join(tiny_assets, "model"), args, str(tmp_path)) as url:
        out = _run(os.path.join(EXAMPLES, "openai_client.py"), "--url", url, "--adapter",
                   "adapter-003-r64")
    assert "adapter-003-r64" in out and "[tiny]" in out
    assert "[adapter-003-r64] " in out and "[adapter-003-r64, streamed] " in out
    assert "now resides on: device" in out


def test_offline_llm(tiny_assets):
    out = _run(os.path.join(EXAMPLES, "offline_llm.py"), "--model",
               os.path.join(tiny_assets, "model"), "--adapters",
               os.path.join(tiny_assets, "adapters"))
    assert "6 adapters in one batch" in out and "(base model)" in out
