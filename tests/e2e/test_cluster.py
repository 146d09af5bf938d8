"""`loraserve cluster up` with 2 tiny CPU engines, started as a user types it:
loopback-only sockets, every adapter served, routing that follows phi
(chi-square), migration on a demand shift without failed requests, a killed
engine that loses no adapter and rejoins after its restart, and Ctrl-C that
leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import psutil
import pytest

from vllm_loraserve.process import free_port

from .bad_adapters import EXPECTED_REASONS, build_bad_adapters

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
SERVE_ARGS = "--dtype float32 --max-model-len 512 --max-loras 8 --max-num-seqs 32"
BAD = {k: v for k, v in EXPECTED_REASONS.items() if k != "rank-256"}


@dataclass
class RunningCluster:
    url: str
    proc: subprocess.Popen
    log: str

    def status(self) -> dict:
        return httpx.get(f"{self.url}/admin/status", timeout=30).json()

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def router_ready(proc: subprocess.Popen, url: str, log: str, timeout: float = 2.0):
    """A `wait_for` predicate: the router of `loraserve cluster up` (`proc`,
    writing `log`) answers /health; its exit fails at once with the log."""
    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"cluster exited:\n{open(log).read()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False
    return ready


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from vllm_loraserve.demo.assets import build_assets

    root = tmp_path_factory.mktemp("cluster")
    assets = str(root / "assets")
    build_assets(assets, num_adapters=25)
    bad = root / "bad"
    bad.mkdir()
    build_bad_adapters(assets, str(bad))
    for name in BAD:  # (a rank-256 one would only raise every engine's max rank)
        os.rename(bad / name, os.path.join(assets, "adapters", name))
    port = free_port()
    log = str(root / "cluster.log")
    cmd = [os.path.join(os.path.dirname(sys.executable), "loraserve"), "cluster", "up",
           "--engines", "2", "--model", os.path.join(assets, "model"),
           "--served-model-name", "tiny", "--adapters", os.path.join(assets, "adapters"),
           "--port", str(port), "--rebalance-s", "0", "--health-interval", "1",
           "--device", "cpu", "--workdir", str(root / "work"), "--serve-args", SERVE_ARGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    c = RunningCluster(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_for(router_ready(proc, c.url, log), 600, "the router")
        yield c
    finally:
        tree = c.tree() if proc.poll() is None else []
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            proc.wait(180)
        finally:
            _, alive = psutil.wait_procs(tree, timeout=30)
            for p in alive:
                p.kill()
        assert proc.returncode == 0, open(log).read()[-3000:]
        assert not alive, f"left running after Ctrl-C: {[p.info for p in alive]}"


async def send(url: str, jobs: list[tuple[str, str]], concurrency: int = 4,
               max_tokens: int = 4) -> list[tuple[str, int, str]]:
    """(model, prompt) jobs -> (model, status, engine) for each."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(model: str, prompt: str):
            async with sem:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0})
                return model, r.status_code, r.headers.get("x-loraserve-engine", "")
        return await asyncio.gather(*(one(m, p) for m, p in jobs))


def adapters(c: RunningCluster) -> dict[str, int]:
    data = httpx.get(f"{c.url}/v1/models", timeout=30).json()["data"]
    return {m["id"]: m["rank"] for m in data if "rank" in m}


def engine_models(url: str) -> set[str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def test_every_listening_socket_is_on_loopback(cluster):
    listening = []
    for p in cluster.tree():
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        listening += [(p.name(), c.laddr.ip, c.laddr.port) for c in conns
                      if c.status == psutil.CONN_LISTEN or c.type == 2]  # 2: UDP
    ports = {port for _, _, port in listening}
    status = cluster.status()
    for info in status["engines"].values():
        assert int(info["url"].rsplit(":", 1)[1]) in ports  # vLLM servers are in the tree
    assert int(cluster.url.rsplit(":", 1)[1]) in ports
    assert len(listening) >= 5
    assert {ip for _, ip, _ in listening} <= LOOPBACK, [x for x in listening
                                                        if x[1] not in LOOPBACK]


def test_every_adapter_is_served_by_a_holder(cluster):
    names = adapters(cluster)
    assert len(names) == 25 and set(names.values()) == {8, 16, 32, 64, 128}
    results = asyncio.run(send(cluster.url, [(a, "Tell me a story") for a in names]
                               + [("tiny", "Tell me a story")]))
    assert all(status == 200 for _, status, _ in results), results
    status = cluster.status()
    for model, _, engine in results:
        if model != "tiny":
            assert int(engine) in {e for e, _ in status["placement"][model]}, model
    for e, info in status["engines"].items():  # the router's adapter table is vLLM's truth
        assert engine_models(info["url"]) == set(info["adapters"]), e


def test_malformed_adapters_are_refused_with_their_reason(cluster):
    assert not set(BAD) & set(adapters(cluster))
    for name, reason in BAD.items():
        r = httpx.post(f"{cluster.url}/v1/completions",
                       json={"model": name, "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, (name, r.text)
        message = r.json()["error"]["message"]
        assert reason in message and "Traceback" not in message and "ray::" not in message


def test_requests_follow_phi(cluster):
    a = "adapter-003-r64"
    r = httpx.put(f"{cluster.url}/admin/placement", json={a: [[0, 0.3], [1, 0.7]]},
                  timeout=120)
    assert r.status_code == 200, r.text
    n = 200
    results = asyncio.run(send(cluster.url, [(a, "hi")] * n, concurrency=8, max_tokens=1))
    assert all(s == 200 for _, s, _ in results)
    counts = Counter(e for _, _, e in results)
    expected = {"0": 0.3 * n, "1": 0.7 * n}
    chi2 = sum((counts[k] - v) ** 2 / v for k, v in expected.items())
    assert chi2 < 10.83, (counts, chi2)  # 1 degree of freedom, p = 0.001


def test_demand_shift_migrates_without_failed_requests(cluster):
    names = adapters(cluster)
    assert httpx.post(f"{cluster.url}/admin/rebalance", timeout=300).status_code == 200
    before = cluster.status()["placement"]
    hot = [a for a, r in names.items() if r == 8]
    asyncio.run(send(cluster.url, [(a, "Write a poem about the sea.") for a in hot] * 12,
                     max_tokens=16))

    async def shift():
        background = asyncio.create_task(send(
            cluster.url, [(a, "List three colours:") for a in names] * 4, concurrency=4))
        await asyncio.sleep(2.0)  # requests in flight on every engine
        async with httpx.AsyncClient(timeout=300) as client:
            r = await client.post(f"{cluster.url}/admin/rebalance")
        return r, await background
    r, results = asyncio.run(shift())
    assert r.status_code == 200 and r.json()["added_pairs"] > 0
    assert [x for x in results if x[1] != 200] == []
    after = cluster.status()["placement"]
    assert after != before
    moved = [a for a in names if {e for e, _ in after[a]} - {e for e, _ in before[a]}]
    assert moved

    def unloaded():  # pairs that left are drained, then unloaded from vLLM
        s = cluster.status()
        return all(engine_models(i["url"]) == {a for a in names if int(e) in
                                               {x for x, _ in s["placement"][a]}}
                   for e, i in s["engines"].items())
    wait_for(unloaded, 60, "unloads after the migration")
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    assert 'loraserve_router_fetches_total{source="peer"}' in metrics


def test_killed_engine_loses_no_adapter_and_rejoins_after_restart(cluster):
    names = adapters(cluster)
    old_pid = cluster.status()["engines"]["0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    # at once, before the router noticed: refused connections are retried
    results = asyncio.run(send(cluster.url, [(a, "hello") for a in names]))
    assert [x for x in results if x[1] != 200] == []

    # `alive` changes before the re-placement onto engine 1 has loaded
    # everything, so wait for both
    def down():
        s = cluster.status()
        moved = all(v == [[1, 1.0]] for v in s["placement"].values())
        return s if s["alive"] == [1] and moved else None
    wait_for(down, 60, "engine 0 to leave routing and its adapters to move to engine 1")
    results = asyncio.run(send(cluster.url, [(a, "hello again") for a in names]))
    assert all(status == 200 and engine == "1" for _, status, engine in results)

    def rejoined():
        s = cluster.status()
        return s if s["alive"] == [0, 1] and s["engines"]["0"]["adapters"] else None
    s = wait_for(rejoined, 600, "engine 0 to restart, rejoin and receive adapters", interval=2)
    assert s["engines"]["0"]["pid"] != old_pid
    results = asyncio.run(send(cluster.url, [(a, "welcome back") for a in names]))
    assert all(status == 200 for _, status, _ in results)
    assert {engine for _, _, engine in results} == {"0", "1"}
    # each phase of the fault was timed, and nothing it held was left unplaced
    *_, fault = httpx.get(f"{cluster.url}/admin/faults", timeout=30).json()["faults"]
    assert fault["engine"] == 0 and fault["held"] and fault["unplaced"] == []
    assert all(fault["replaced"][a] == [1] for a in fault["held"])
    for phase in ("detection_s", "replacement_s", "first_served_s", "rejoin_s"):
        assert fault[phase] is not None and fault[phase] >= 0, phase
    assert fault["given_on_rejoin"]
