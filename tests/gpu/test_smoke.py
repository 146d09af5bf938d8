"""GPU smoke test (marker `gpu`; run through the device tool, never in CI).

`vllm serve <dummy ~1.1B Llama> --plugin loraserve --enable-lora ...` on a
Hopper GPU with vLLM 0.26 (the paged pool, its default): adapters of every
rank answer like the same server without the plugin, and the adapter
listing (with pages), the bad-adapter refusal and the per-adapter metrics
work. Results go to $LORASERVE_RESULTS_DIR/gpu_smoke.json.

The oracle is not bit equality of greedy tokens, which failed once in two
runs (adapter-004-r128 differed). Both servers' LoRA shrink kernels split K
and add partial sums with fp32 atomics (vLLM's and ours), so the order of
additions, and the bf16 rounding after it, changes from run to run; with
dummy weights the next-token distribution is nearly flat and near-ties are
common, so greedy tokens flip now and then. The test records this: the
stock server answers every request twice, and the two passes' logprobs are
compared. The oracle instead checks what must hold whatever the rounding:
- on the tokens both servers chose, logprobs agree within LOGPROB_TOL;
- where they first choose differently, each server scores the other's token
  within TIE_GAP of its own (two engines within LOGPROB_TOL of each other
  can disagree only there); later tokens follow different inputs and are
  not compared.
"""

from __future__ import annotations

import itertools
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
MAX_TOKENS = 16
LOGPROB_TOL = 0.2  # one bf16 server against another, per token
TIE_GAP = 2 * LOGPROB_TOL
TOP = 20  # alternatives per position (vLLM's default max_logprobs); a token
# outside them counts as no near tie
COMMON = ["--load-format", "dummy", "--max-lora-rank", "128", "--max-loras", "4",
          "--served-model-name", "llama-1b"]


@pytest.fixture(scope="module")
def assets(fixed_dir):
    root = fixed_dir("llama1b")
    model = str(root / "model")
    build_model(model, preset="llama-1b")
    records = build_adapters(model, str(root / "adapters"), 6, base_model="llama-1b",
                             targets=ALL_TARGETS)
    bad = root / "bad"
    make_adapter(str(bad / "rank-256"), module_dims(model, ("q_proj",)), rank=256, alpha=16,
                 seed=9, base_model="llama-1b")
    return model, str(root / "adapters"), str(bad), records


def _greedy(url: str, names: list[str]) -> dict[str, dict]:
    """One request at a time, so both servers see identical batches; token
    ids, their logprobs and the TOP best alternatives at each position."""
    out = {}
    for name in names:
        for i, prompt in enumerate(PROMPTS):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": TOP, "return_tokens_as_token_ids": True})
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            out[f"{name}#{i}"] = {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                                  "top": lp["top_logprobs"]}
    return out


def _compare(a: dict, b: dict) -> tuple[list[str], dict]:
    """Problems (empty when the oracle holds) and what was seen, for one request."""
    problems = []
    diverge = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True))
                    if x != y), None)
    shared = range(diverge if diverge is not None else len(a["tokens"]))
    deltas = [abs(a["logprobs"][i] - b["logprobs"][i]) for i in shared]
    if deltas and max(deltas) > LOGPROB_TOL:
        problems.append(f"logprobs differ by {max(deltas):.3f} at {deltas.index(max(deltas))}")
    gaps = None
    if diverge is not None:
        # Each server's score gap between its own token and the other's.
        gaps = [own["logprobs"][diverge] - own["top"][diverge].get(other["tokens"][diverge],
                                                                  float("-inf"))
                for own, other in ((a, b), (b, a))]
        if max(gaps) > TIE_GAP:
            problems.append(f"greedy tokens differ at {diverge} where they are no near tie "
                            f"(gaps {gaps[0]:.3f}, {gaps[1]:.3f})")
    return problems, {"max_delta": max(deltas, default=0.0), "diverge": diverge, "gaps": gaps}


def test_plugin_server_matches_stock_server(assets, tmp_path):
    model, adapter_dir, bad_dir, records = assets
    names = [r.name for r in records]
    results: dict = {"adapters": [{"name": r.name, "rank": r.rank} for r in records],
                     "logprob_tol": LOGPROB_TOL, "tie_gap": TIE_GAP}

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
        stock_again = _greedy(url, ["llama-1b", *names])

    problems, per_request = [], {}
    for key in stock:
        found, seen = _compare(with_plugin[key], stock[key])
        problems += [f"{key}: {p}" for p in found]
        per_request[key] = seen
    # Run-to-run: the same stock server, the same requests, a second time.
    repeat = [_compare(stock[k], stock_again[k])[1] for k in stock]
    residency = {a["name"]: a for a in listing["adapters"]}
    requests = {dict(labels)["adapter"]: v for (name, labels), v in samples.items()
                if name == "loraserve_adapter_requests_total"}
    results.update({
        "per_request": per_request,
        "plugin_vs_stock": {"diverged": sum(r["diverge"] is not None
                                            for r in per_request.values()),
                            "max_delta": max(r["max_delta"] for r in per_request.values())},
        "stock_vs_stock": {"diverged": sum(r["diverge"] is not None for r in repeat),
                           "max_delta": max(r["max_delta"] for r in repeat),
                           "bitwise_equal": stock == stock_again},
        "n_outputs": len(stock),
        "distinct_outputs": len({json.dumps(v["tokens"]) for v in stock.values()}),
        "residency": {n: (a.get("residency", a["status"]), a.get("pages")) for n, a in
                      residency.items()},
        "bad_adapter": {"status": bad.status_code, "message": bad.json()["error"]["message"]},
        "requests_per_adapter": requests,
    })
    out_dir = os.environ.get("LORASERVE_RESULTS_DIR")
    if out_dir:
        json.dump(results, open(os.path.join(out_dir, "gpu_smoke.json"), "w"), indent=1)
        for log in ("server-plugin.log", "server.log"):
            os.replace(tmp_path / log, os.path.join(out_dir, log))

    assert not problems, "\n".join(problems)
    assert results["distinct_outputs"] > len(names)  # adapters change the outputs
    assert bad.status_code == 400 and "rank 256" in results["bad_adapter"]["message"]
    # The pool has no slot cap: all six adapters stay in KV pages, each at its rank.
    pages = {n: residency[n].get("pages") for n in names}
    assert all(residency[n]["residency"] == "device" for n in names), results["residency"]
    by_rank = {r.rank: pages[r.name] for r in records}
    assert all(by_rank[a] < by_rank[b] for a, b in itertools.pairwise(sorted(by_rank)))
    assert all(requests[n] == len(PROMPTS) for n in names)
