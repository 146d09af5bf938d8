"""Issue 25: an adapter migrates between two GPU engines over NIXL and
answers the same there.

`loraserve cluster up --device cuda --engines 2 --engines-per-gpu 2
--transport nixl`: both engines on one GPU, each in its Ray actor, so the
two NIXL agents live in two processes and UCX can use CUDA IPC. Each adapter
is placed on engine 0 alone and answers a greedy request there; the
placement then moves it to engine 1, which fetches it from engine 0, and
back to engine 0, twice. After every move:

- the fetch went over NIXL: the router's
  `loraserve_router_peer_fetches_total{transport="nixl"}` grew by one (a
  fall back to TCP fails the test, with its log line in the output);
- the new holder's copy of the adapter is byte for byte the source's;
- the new holder's answer equals the old holder's within the GPU oracle's
  tolerance (tests/e2e/reference.py `Bf16Tolerance`): the same tokens up to
  a near tie (the old holder's top two within `tie_gap`), the chosen
  tokens' logprobs within `max` each and `mean` over the answer. Both run
  the same model and kernels on the same GPU, so the answers are expected
  to be identical, and the record says whether they were;
- and the adapter's answer is not the base model's, so a move that lost
  the adapter could not pass.

The same runs with `--transport tcp` for its timings (module parameter;
LORASERVE_CLUSTER_TRANSPORTS=nixl runs nixl alone, saving a cluster start).
Recorded in $LORASERVE_RESULTS_DIR/cluster-migration.json per transport and
move: the adapter's rank and bytes, the fetch's seconds (the engine's own
timing) and the time from the placement request to the first request the
new holder answered (the decision, fetch, load into vLLM, routing switch
and one 16-token request).
"""

from __future__ import annotations

import datetime
import hashlib
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

from ..e2e.reference import Bf16Tolerance
from ..e2e.test_cluster import router_ready, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
TOL = Bf16Tolerance()
ADAPTERS = {"m8": 8, "m128": 128}
ROUND_TRIPS = 2  # engine 0 -> 1 -> 0, twice per adapter
MAX_TOKENS = 16
PROMPT = "The cluster moved this adapter"
SERVE_ARGS = "--dtype bfloat16 --max-model-len 512 --enforce-eager --max-num-seqs 16"
TRANSPORTS = os.environ.get("LORASERVE_CLUSTER_TRANSPORTS", "nixl,tcp").split(",")
RESULTS: dict[str, list[dict]] = {}


def _skip_reason(transport: str) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    for module in ("ray", *(("nixl",) if transport == "nixl" else ())):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the cluster bundle carries it)"
    return None


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(url: str, model: str) -> tuple[int, list[str], list[dict[str, float]]]:
    """(engine, tokens, top-2 logprobs per position) of a greedy answer."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return int(r.headers["x-loraserve-engine"]), lp["tokens"], lp["top_logprobs"]


def _compare(a: tuple[list, list], b: tuple[list, list]) -> dict:
    """How answer `b` sits from answer `a` (tokens, top logprobs); AssertionError
    past the tolerance. Compared up to the first differing token, which must
    be a near tie in `a`; after it the two continue from different inputs."""
    deltas = []
    for i, (ta, tb) in enumerate(zip(a[0], b[0], strict=True)):
        la, lb = a[1][i], b[1][i]
        if ta != tb:
            top = sorted(la.values(), reverse=True)
            assert len(top) > 1 and top[0] - top[1] <= TOL.tie_gap, (i, ta, tb, la, lb)
            break
        deltas.append(abs(la[ta] - lb[tb]))
    assert deltas, "the first token already differs"
    assert max(deltas) <= TOL.max and sum(deltas) / len(deltas) <= TOL.mean, deltas
    return {"compared_tokens": len(deltas), "max_delta": max(deltas),
            "identical": a == b}


def _tree_digest(path: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            full = os.path.join(d, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, tmp_path_factory):
    transport = request.param
    reason = _skip_reason(transport)
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp(f"gpu-cluster-{transport}")
    model = str(root / "model")
    build_model(model, preset="small", seed=3)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        make_adapter(str(root / "adapters" / name), module_dims(model, ALL_TARGETS), rank=rank,
                     alpha=2 * rank, seed=i, base_model="small")
    port = free_port()
    log = str(root / "cluster.log")
    cmd = [sys.executable, "-m", "vllm_loraserve.cli.main", "cluster", "up",
           "--engines", "2", "--engines-per-gpu", "2", "--device", "cuda",
           "--transport", transport, "--model", model, "--served-model-name", "small",
           "--adapters", str(root / "adapters"), "--port", str(port), "--rebalance-s", "0",
           "--health-interval", "1", "--workdir", str(root / "work"),
           "--serve-args", SERVE_ARGS]
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(router_ready(proc, url, log, timeout=5), 400, "the router")
        print(f"{transport} cluster up in {time.monotonic() - t0:.0f} s", flush=True)
        yield transport, url, root, log
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        print(open(log).read()[-4000:])


def test_an_adapter_migrates_and_answers_the_same(cluster):
    transport, url, root, log = cluster

    def holds(engine: int) -> dict:
        return httpx.get(f"{url}/admin/status", timeout=30).json()["engines"][str(engine)]

    def held_only_by(name: str, engine: int) -> bool:
        return all((name in holds(e)["adapters"]) == (e == engine) for e in (0, 1))

    def place(name: str, engine: int) -> None:
        r = httpx.put(f"{url}/admin/placement", json={name: [[engine, 1.0]]}, timeout=300)
        assert r.status_code == 200, r.text

    def metrics() -> str:
        return httpx.get(f"{url}/metrics", timeout=30).text

    records = RESULTS.setdefault(transport, [])
    for name, rank in ADAPTERS.items():
        place(name, 0)
        wait_for(lambda n=name: held_only_by(n, 0), 300, f"{name} on engine 0 alone")
        engine, *first_answer = _complete(url, name)
        assert engine == 0
        _, *base = _complete(url, "small")
        assert base[0] != first_answer[0] or any(
            abs(max(x.values()) - max(y.values())) > TOL.max
            for x, y in zip(base[1], first_answer[1], strict=True)), \
            f"{name} answers as the base model: the test could not see it lost"
        source = _tree_digest(str(root / "adapters" / name))
        answer, holder = first_answer, 0
        for _ in range(2 * ROUND_TRIPS):
            new = 1 - holder
            before = metrics()
            t0 = time.monotonic()
            place(name, new)
            # the first request the new holder answers: the end of the migration
            first = wait_for(lambda n=name, e=new, t0=t0: _complete(url, n)[0] == e
                          and time.monotonic() - t0, 300, f"{name} answered by engine {new}",
                          interval=0.05)
            after = metrics()
            engine, *new_answer = _complete(url, name)
            assert engine == new
            compared = _compare(answer, new_answer)
            copy = _tree_digest(str(root / "work" / f"engine-{new}" / "adapters" / name))
            assert copy == source, f"engine {new}'s copy of {name} differs from the source"

            def grew(metric: str, labels: str, a=after, b=before) -> float:
                return _metric(a, metric, labels) - _metric(b, metric, labels)
            via = {t: grew("loraserve_router_peer_fetches_total", f'transport="{t}"')
                   for t in ("nixl", "tcp")}
            assert via == {t: float(t == transport) for t in via}, \
                f"{name} moved to engine {new} over {via}, not {transport} alone"
            records.append({
                "adapter": name, "rank": rank, "move": f"{holder}->{new}",
                "bytes": int(grew("loraserve_router_fetch_bytes_total", 'source="peer"')),
                "fetch_s": round(grew("loraserve_router_fetch_seconds_sum", 'source="peer"'), 4),
                "placement_to_first_request_s": round(first, 3), **compared})
            print(json.dumps({"transport": transport, **records[-1]}), flush=True)
            wait_for(lambda n=name, e=new: held_only_by(n, e), 300, f"{name} on engine {new} alone")
            answer, holder = new_answer, new
    if transport == "nixl":
        text = open(log).read()
        assert "using tcp" not in text and "nixl transport unavailable" not in text
    _write_results()


def _write_results() -> None:
    out = os.environ.get("LORASERVE_RESULTS_DIR")
    if not out:
        return
    import torch

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cluster-migration.json"), "w") as f:
        json.dump({"test": "tests/gpu/test_cluster_gpu.py: 2 engines on one GPU, moves "
                           "0->1->0 per adapter", "device": torch.cuda.get_device_name(),
                   "date": datetime.date.today().isoformat(),
                   "commit": os.environ.get("LORASERVE_COMMIT", "unknown"),
                   "model": "demo preset small (Llama, hidden 512, 4 layers)",
                   "adapters": "all 7 linear targets", "serve_args": SERVE_ARGS,
                   "tolerance": {"max": TOL.max, "mean": TOL.mean, "tie_gap": TOL.tie_gap},
                   "transports": RESULTS}, f, indent=1)
