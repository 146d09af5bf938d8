"""`vllm serve --plugin loraserve --api-key KEY`: the plugin's routes need the
key as vLLM's /v1 does, and what they show of the server stays within the
adapter roots. Also: the flags the README repeats, the device tier's name and
the pool's counters, as a real server reports them."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from .server import metric_samples, vllm_server

pytestmark = pytest.mark.e2e
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_assets, tmp_path_factory):
    """Adapters in two --loraserve-adapter-dir roots and one --lora-modules
    adapter under neither. Yields (url, server log path, the outside dir)."""
    adapters = os.path.join(tiny_assets, "adapters")
    second, outside = tmp_path_factory.mktemp("second"), tmp_path_factory.mktemp("outside")
    shutil.copytree(os.path.join(adapters, "adapter-000-r8"), second / "extra-r8")
    shutil.copytree(os.path.join(adapters, "adapter-001-r16"), outside / "private-r16")
    log_dir = str(tmp_path_factory.mktemp("log"))
    args = ["--plugin", "loraserve", "--api-key", KEY, "--served-model-name", "tiny",
            "--max-lora-rank", "128", "--loraserve-adapter-dir", adapters,
            "--loraserve-adapter-dir", str(second),
            "--lora-modules", f"static-out={outside}/private-r16"]
    with vllm_server(os.path.join(tiny_assets, "model"), args, log_dir) as url:
        yield url, os.path.join(log_dir, "server.log"), outside


ROUTES = ("/loraserve/v1/adapters", "/loraserve/v1/adapters/extra-r8", "/loraserve/v1/model")


def test_plugin_routes_need_the_key(keyed):
    url, _, _ = keyed
    for route in (*ROUTES, "/v1/models"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{url}{route}", headers=headers, timeout=60)
            assert r.status_code == 401, (route, headers, r.text)
        assert httpx.get(f"{url}{route}", headers=AUTH, timeout=60).status_code == 200, route
    # vLLM leaves /metrics open; the plugin's refresh on it follows
    assert httpx.get(f"{url}/metrics", timeout=60).status_code == 200


def test_listing_shows_no_server_paths(keyed, tiny_assets):
    url, _, outside = keyed
    r = httpx.get(f"{url}/loraserve/v1/adapters", headers=AUTH, timeout=60)
    listed = {a["name"]: a for a in r.json()["adapters"]}
    assert listed["extra-r8"]["path"] == "extra-r8"  # the second directory's
    assert listed["adapter-003-r64"]["path"] == "adapter-003-r64"
    assert listed["static-out"]["path"] == "private-r16"  # under no root: its name
    assert tiny_assets not in r.text and str(outside) not in r.text
    assert r.json()["device_type"] == "cpu"


def test_repeated_adapter_dirs_without_warning(keyed):
    _, log, _ = keyed
    with open(log, errors="replace") as f:
        assert "Found duplicate keys" not in f.read()


def test_device_tier_and_pool_counters(keyed):
    """On CPU the tier the kernels read is `device` (it said "gpu"), and the
    pool's totals are counters."""
    url, _, _ = keyed
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "extra-r8", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    one = httpx.get(f"{url}/loraserve/v1/adapters/extra-r8", headers=AUTH, timeout=60).json()
    assert (one["residency"], one["device_type"]) == ("device", "cpu") and one["pages"] > 0
    after = metric_samples(url)
    assert after[("loraserve_adapters", (("state", "device"),))] >= 1
    assert after[("loraserve_pool_page_events_total", (("event", "load"),))] >= 1
    assert after[("loraserve_adapter_loads_total",
                  (("adapter", "extra-r8"), ("tier", "device")))] >= 1
