"""Issue 25: an adapter migrates between two GPU engines over NIXL.

`loraserve cluster up --device cuda --engines 2 --engines-per-gpu 2
--transport nixl` (both engines on one GPU, each in its Ray actor, so the two
NIXL agents live in two processes and UCX can use CUDA IPC). Each adapter is
placed on engine 0 and answers a greedy request there; the placement then
moves it to engine 1, which fetches it from engine 0 over NIXL (the router's
`loraserve_router_peer_fetches_total{transport="nixl"}`; a fallback to TCP
fails the test), and answers the same request. Both engines run the same
model and kernels on the same GPU, so the answers agree: the same tokens up
to a near-tie, and the chosen tokens' logprobs within LOGPROB_TOL.

Recorded in LORASERVE_RESULTS_DIR (cluster-migration.json): per adapter its
rank, bytes moved and the time from the placement change to the first
request engine 1 answered for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from vllm_loraserve.demo.assets import ALL_TARGETS, build_model, make_adapter, module_dims
from vllm_loraserve.process import free_port

from ..e2e.test_cluster import wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
LOGPROB_TOL = 0.05  # bf16: the same kernels on the same GPU, batch of one
NEAR_TIE = 0.1  # tokens may differ only where the top two logprobs were this close
ADAPTERS = {"m8": 8, "m128": 128}
MAX_TOKENS = 16
SERVE_ARGS = ("--dtype bfloat16 --max-model-len 512 --enforce-eager --max-num-seqs 16 "
              "--max-lora-rank 128")


def _skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    for module in ("ray", "nixl"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the cluster bundle carries it)"
    return None


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(url: str, model: str) -> tuple[int, list, list]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "The cluster moved this adapter", "max_tokens": MAX_TOKENS,
        "temperature": 0, "logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return int(r.headers["x-loraserve-engine"]), lp["tokens"], lp["top_logprobs"]


def _same_answer(a: tuple[list, list], b: tuple[list, list]) -> None:
    """Equal tokens with close logprobs, up to a near-tie (then stop)."""
    for i, (ta, tb) in enumerate(zip(a[0], b[0], strict=True)):
        la, lb = a[1][i], b[1][i]
        if ta != tb:
            top = sorted(la.values(), reverse=True)
            assert len(top) > 1 and top[0] - top[1] < NEAR_TIE, (i, ta, tb, la, lb)
            return
        assert abs(la[ta] - lb[tb]) <= LOGPROB_TOL, (i, ta, la, lb)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("gpu-cluster")
    model = str(root / "model")
    build_model(model, preset="small", seed=3)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        make_adapter(str(root / "adapters" / name), module_dims(model, ALL_TARGETS), rank=rank,
                     alpha=2 * rank, seed=i, base_model="small")
    port = free_port()
    log = str(root / "cluster.log")
    cmd = [sys.executable, "-m", "vllm_loraserve.cli.main", "cluster", "up",
           "--engines", "2", "--engines-per-gpu", "2", "--device", "cuda",
           "--transport", "nixl", "--model", model, "--served-model-name", "small",
           "--adapters", str(root / "adapters"), "--port", str(port), "--rebalance-s", "0",
           "--health-interval", "1", "--workdir", str(root / "work"),
           "--serve-args", SERVE_ARGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, open(log).read()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_for(ready, 600, "the router")
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        print(open(log).read()[-4000:])


def test_an_adapter_migrates_over_nixl_and_answers_the_same(cluster):
    url, log = cluster
    status = lambda: httpx.get(f"{url}/admin/status", timeout=30).json()  # noqa: E731

    def held_only_by(name: str, engine: int):
        engines = status()["engines"]
        return all((name in engines[str(e)]["adapters"]) == (e == engine) for e in (0, 1))

    def place(name: str, engine: int) -> None:
        r = httpx.put(f"{url}/admin/placement", json={name: [[engine, 1.0]]}, timeout=300)
        assert r.status_code == 200, r.text

    records = []
    for name, rank in ADAPTERS.items():
        place(name, 0)
        wait_for(lambda n=name: held_only_by(n, 0), 300, f"{name} on engine 0 alone")
        engine, *before = _complete(url, name)
        assert engine == 0
        metrics0 = httpx.get(f"{url}/metrics", timeout=30).text
        t0 = time.monotonic()
        place(name, 1)
        # The first request engine 1 answers for it: the end of the migration.
        first = wait_for(lambda n=name, t0=t0: _complete(url, n)[0] == 1 and time.monotonic() - t0,
                      300, f"{name} answered by engine 1", interval=0.05)
        engine, *after = _complete(url, name)
        assert engine == 1
        _same_answer(before, after)
        metrics1 = httpx.get(f"{url}/metrics", timeout=30).text
        moved = (_metric(metrics1, "loraserve_router_fetch_bytes_total", 'source="peer"')
                 - _metric(metrics0, "loraserve_router_fetch_bytes_total", 'source="peer"'))
        nixl = (_metric(metrics1, "loraserve_router_peer_fetches_total", 'transport="nixl"')
                - _metric(metrics0, "loraserve_router_peer_fetches_total", 'transport="nixl"'))
        assert nixl == 1 and moved > 0, (nixl, moved)
        records.append({"adapter": name, "rank": rank, "bytes": moved,
                        "placement_to_first_request_s": round(first, 3)})
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert _metric(metrics, "loraserve_router_peer_fetches_total", 'transport="tcp"') == 0
    assert "does not serve nixl" not in open(log).read()
    out = os.environ.get("LORASERVE_RESULTS_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cluster-migration.json"), "w") as f:
            json.dump({"test": "nixl migration, 2 engines on one GPU", "serve_args": SERVE_ARGS,
                       "migrations": records}, f, indent=1)
    print(json.dumps(records))
