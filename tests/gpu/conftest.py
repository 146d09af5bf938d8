"""GPU tests build their assets under a fixed path rather than pytest's
per-run temporary directories: vLLM keys its compile cache by the model's
path, so a second run on the same machine reuses the compiled model instead
of compiling it again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def fixed_dir():
    def make(name: str) -> Path:
        root = Path(os.environ.get("LORASERVE_GPU_ASSETS", "/tmp/loraserve-gpu-assets")) / name
        shutil.rmtree(root, ignore_errors=True)  # rebuilt every run: deterministic assets
        root.mkdir(parents=True)
        return root

    return make
