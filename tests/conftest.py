"""Shared fixtures: locally built demo assets (no hub, deterministic)."""

from __future__ import annotations

import os

import pytest
import torch

# CPU vLLM sizes its KV cache from this; without it start-up fails.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Without a GPU, Triton kernels run on the CPU under Triton's interpreter.
# Set before any test module imports triton (vLLM does, from several test
# modules): triton's own jit'd library functions (tl.cdiv, ...) are made
# interpretable only if the variable is set when triton is imported.
# tests/e2e/conftest.py keeps it from the vLLM processes those tests start.
# With a GPU (the `gpu` marker's runs) the kernels must be the compiled ones.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _split_xdist_engines() -> None:
    """Under pytest-xdist (`make test` runs `-n 2`) the vLLM engines each
    worker starts bind a core of their own (unless a test binds them): CPU
    vLLM binds its threads to core 0 by default, so two workers' engines
    would share one core and leave the other idle. The workers themselves
    keep every core (tests of the CPU LoRA workers place those on several),
    with one torch thread each. Outside xdist nothing changes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
    torch.set_num_threads(1)


_split_xdist_engines()


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> str:
    """The demo's tiny Llama with 6 adapters (ranks 8..128, then 8 again)."""
    from vllm_loraserve.demo.assets import build_assets

    out = str(tmp_path_factory.mktemp("tiny"))
    build_assets(out, num_adapters=6)
    return out


@pytest.fixture(scope="session")
def qwen_assets(tmp_path_factory) -> str:
    """A tiny Qwen2 (attention biases) model without adapters."""
    from vllm_loraserve.demo.assets import build_model

    out = str(tmp_path_factory.mktemp("qwen"))
    build_model(os.path.join(out, "model"), preset="tiny-qwen2", seed=7)
    return out
