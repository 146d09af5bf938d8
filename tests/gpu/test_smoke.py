"""GPU smoke test (marker `gpu`; run through the device tool, never in CI).

`vllm serve <dummy ~1.1B Llama> --plugin loraserve --enable-lora ...` on a
Hopper GPU with vLLM 0.26: adapters of every rank answer, greedy outputs equal
those of the same server without the plugin, and the adapter listing, the
bad-adapter refusal and the per-adapter metrics work. Results go to
$LORASERVE_RESULTS_DIR/gpu_smoke.json.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from vllm_loraserve.demo.assets import (
    ALL_TARGETS,
    build_adapters,
    build_model,
    make_adapter,
    module_dims,
)

from ..e2e.server import metric_samples, vllm_server

pytestmark = pytest.mark.gpu
PROMPTS = ["Tell me a story about a cat.", "List three colours:", "Write a poem about the sea."]
COMMON = ["--load-format", "dummy", "--max-lora-rank", "128", "--max-loras", "4",
          "--served-model-name", "llama-1b"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama1b")
    model = str(root / "model")
    build_model(model, preset="llama-1b")
    records = build_adapters(model, str(root / "adapters"), 6, base_model="llama-1b",
                             targets=ALL_TARGETS)
    bad = root / "bad"
    make_adapter(str(bad / "rank-256"), module_dims(model, ("q_proj",)), rank=256, alpha=16,
                 seed=9, base_model="llama-1b")
    return model, str(root / "adapters"), str(bad), records


def _greedy(url: str, names: list[str]) -> dict[str, list]:
    """One request at a time, so both servers see identical batches."""
    out = {}
    for name in names:
        for i, prompt in enumerate(PROMPTS):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out[f"{name}#{i}"] = choice.get("token_ids") or choice["text"]
    return out


def test_plugin_server_equals_stock_server(assets, tmp_path):
    model, adapter_dir, bad_dir, records = assets
    names = [r.name for r in records]
    results: dict = {"adapters": [{"name": r.name, "rank": r.rank} for r in records]}

    t0 = time.time()
    plugin_args = [*COMMON, "--plugin", "loraserve", "--loraserve-adapter-dir", adapter_dir,
                   "--loraserve-adapter-dir", bad_dir]
    with vllm_server(model, plugin_args, str(tmp_path), dtype="bfloat16", timeout=480) as url:
        results["plugin_start_s"] = time.time() - t0
        with_plugin = _greedy(url, ["llama-1b", *names])
        listing = httpx.get(f"{url}/loraserve/v1/adapters", timeout=60).json()
        bad = httpx.post(f"{url}/v1/completions", timeout=60,
                         json={"model": "rank-256", "prompt": "x", "max_tokens": 2})
        samples = metric_samples(url)
    os.rename(tmp_path / "server.log", tmp_path / "server-plugin.log")

    t0 = time.time()
    stock_args = [*COMMON, "--lora-modules",
                  *(f"{r.name}={os.path.join(adapter_dir, r.name)}" for r in records)]
    with vllm_server(model, stock_args, str(tmp_path), dtype="bfloat16", timeout=480) as url:
        results["stock_start_s"] = time.time() - t0
        stock = _greedy(url, ["llama-1b", *names])

    residency = {a["name"]: a.get("residency", a["status"]) for a in listing["adapters"]}
    requests = {dict(labels)["adapter"]: v for (name, labels), v in samples.items()
                if name == "loraserve_adapter_requests_total"}
    results.update({
        "outputs_equal": with_plugin == stock,
        "n_outputs": len(stock),
        "distinct_outputs": len({json.dumps(v) for v in stock.values()}),
        "residency": residency,
        "bad_adapter": {"status": bad.status_code, "message": bad.json()["error"]["message"]},
        "requests_per_adapter": requests,
    })
    out_dir = os.environ.get("LORASERVE_RESULTS_DIR")
    if out_dir:
        json.dump(results, open(os.path.join(out_dir, "gpu_smoke.json"), "w"), indent=1)
        for log in ("server-plugin.log", "server.log"):
            os.replace(tmp_path / log, os.path.join(out_dir, log))

    assert with_plugin == stock
    assert results["distinct_outputs"] > len(names)  # adapters change the outputs
    assert bad.status_code == 400 and "rank 256" in results["bad_adapter"]["message"]
    # 4 device slots and (vLLM's default) as many host slots: the 4 adapters
    # used last sit on the GPU, the older ones were evicted to disk.
    assert [residency[n] for n in names] == ["disk"] * (len(names) - 4) + ["gpu"] * 4
    assert all(requests[n] == len(PROMPTS) for n in names)
