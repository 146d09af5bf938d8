"""What the demos leave behind (assets, logs) stays out of git."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from vllm_loraserve.cli.main import build_parser

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("argv", [["demo"], ["cluster", "demo"]])
def test_default_workdir_is_ignored(argv):
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    workdir = build_parser().parse_args(argv).workdir
    probe = os.path.join(workdir, "assets", "model", "model.safetensors")
    r = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert r.returncode == 0, f"{workdir} (`loraserve {' '.join(argv)}`) is not in .gitignore"
