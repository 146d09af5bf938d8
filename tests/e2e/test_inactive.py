"""An installed plugin without --plugin loraserve changes nothing."""

from __future__ import annotations

import os

import httpx
import pytest

from .bad_adapters import build_bad_adapters
from .server import metric_samples, vllm_server

pytestmark = pytest.mark.e2e


def test_server_without_plugin_is_stock_vllm(tiny_assets, tmp_path):
    build_bad_adapters(tiny_assets, str(tmp_path / "bad"))
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    args = ["--max-lora-rank", "128", "--lora-modules", f"a={good}"]
    with vllm_server(os.path.join(tiny_assets, "model"), args, str(tmp_path)) as url:
        assert httpx.get(f"{url}/loraserve/v1/adapters").status_code == 404
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": "a", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        assert metric_samples(url) == {}
        log = open(tmp_path / "server.log").read()
        assert "LoraServeWorkerExtension" not in log and "vllm-loraserve active" not in log
