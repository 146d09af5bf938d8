"""An installed plugin without --plugin loraserve changes nothing, also on a
vLLM that lacks a symbol the plugin patches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import httpx
import pytest

from vllm_loraserve.process import free_port, vllm_executable

from .bad_adapters import build_bad_adapters
from .server import metric_samples, vllm_server

pytestmark = pytest.mark.e2e

PROBE = os.path.join(os.path.dirname(__file__), "inactive_probe.py")


def _probe_env(tmp_path) -> dict[str, str]:
    """Every process of the server imports inactive_probe.py as sitecustomize."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PROBE, site / "sitecustomize.py")
    reports = tmp_path / "reports"
    reports.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "LORASERVE_PROBE_DIR": str(reports)}


def _reports(tmp_path) -> list[dict]:
    return [json.load(open(p)) for p in sorted((tmp_path / "reports").glob("*.json"))]


def test_server_without_plugin_is_stock_vllm(tiny_assets, tmp_path):
    """Stock `vllm serve` with the plugin installed but not requested: no vLLM
    function is replaced in any of its processes, and a simulated missing
    patch target only logs a warning."""
    build_bad_adapters(tiny_assets, str(tmp_path / "bad"))
    good = os.path.join(tiny_assets, "adapters", "adapter-000-r8")
    args = ["--max-lora-rank", "128", "--lora-modules", f"a={good}"]
    env = _probe_env(tmp_path)
    with vllm_server(os.path.join(tiny_assets, "model"), args, str(tmp_path), env=env) as url:
        assert httpx.get(f"{url}/loraserve/v1/adapters", timeout=120).status_code == 404
        # A CPU engine's first request loads the adapter: not within httpx's 5 s default.
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "a", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        assert metric_samples(url) == {}
        import time

        time.sleep(1.0)  # every process has written a report since serving
        reports = _reports(tmp_path)
        log = open(tmp_path / "server.log").read()
    assert "LoraServeWorkerExtension" not in log and "vllm-loraserve active" not in log
    assert "EngineArgs.loraserve_simulated_missing is missing" in log
    registered = [r for r in reports if r["registered"]]
    # the API server and the engine core (the worker shares it on CPU) loaded the plugin
    assert len(registered) >= 2, reports
    assert all(r["wrapped"] == [] for r in reports), [r["wrapped"] for r in reports]


def test_requested_plugin_refuses_a_vllm_missing_a_patch_target(tiny_assets, tmp_path):
    """The same simulated drift with --plugin loraserve: vLLM stops at once,
    naming the missing symbol."""
    env = {**os.environ, **_probe_env(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [vllm_executable(), "serve", os.path.join(tiny_assets, "model"), "--enable-lora",
           "--plugin", "loraserve", "--host", "127.0.0.1", "--port", str(free_port())]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "EngineArgs.loraserve_simulated_missing is missing" in out.stderr + out.stdout
    assert "Starting vLLM server" not in out.stderr + out.stdout
