"""Soak: many adapters, runtime load/unload churn, clients that leave mid-stream.

One `vllm serve --plugin loraserve` on 127.0.0.1 serves `adapters` demo
adapters: half from an adapter directory, half loaded and unloaded at
runtime (from a `--loraserve-allowed-root`) by a churn task while
`concurrency` clients send `requests` completions, each naming any adapter,
streamed or not; some streaming clients close the connection after the
first chunk. With `same_name_churn` N, a second task hammers N of the
churned names (issue 22): every churn pause it sends a load, an in-place
reload and an unload of one of them at the same moment, racing the churner
and the clients that name it. No adapter file changes on disk during the run.

Pass (issue 11): no 5xx and no transport error; every request answered
(200 with a complete body) or refused with a 4xx whose body says why (e.g.
vLLM's 404 for a churned adapter that is unloaded right now); RSS of the
server's whole process tree grows by less than `max_rss_growth` from the
second to the last quarter of the run (mean of the samples in each); at the
end, every model in `/v1/models` is listed once and is a ready adapter of
`GET /loraserve/v1/adapters` (or the alias of one of its versions), and the
worker holds no copy no listed adapter owns (`orphans`). With same-name
churn, a load refused as already loaded (400) and an unload of a name gone
(404) are the races' expected answers; any other non-200 churn answer fails.
Used by tests/e2e/test_soak.py (short) and benchmarks/soak/run_soak.py (long).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from vllm_loraserve.demo.assets import build_assets
from vllm_loraserve.process import Server, free_port, vllm_executable

MODEL = "tiny"  # the served model name


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    adapters: int = 200  # half in the adapter directory, half churned at runtime
    concurrency: int = 16
    max_tokens: int = 8
    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.1  # of the streamed requests
    churn_pause_s: float = 0.1  # between two runtime loads/unloads
    same_name_churn: int = 0  # churned names also loaded/reloaded/unloaded at once (0: off)
    host_cache_bytes: int = 64 << 20
    max_rss_growth: float = 0.05
    seed: int = 0


@dataclass
class SoakResult:
    config: dict
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)  # ok/refused/disconnected/bad
    statuses: dict[str, int] = field(default_factory=dict)  # HTTP status -> requests
    refusals: dict[str, int] = field(default_factory=dict)  # "status: message" -> count
    bad: list[str] = field(default_factory=list)  # what went wrong, first 50
    # "load 200", "unload 200", ...; "... race": a same-name race's expected refusal
    churn: dict[str, int] = field(default_factory=dict)
    end_state: list[str] = field(default_factory=list)  # disagreements at the end
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (s, bytes)
    rss_q2_mb: float = 0.0
    rss_q4_mb: float = 0.0
    rss_growth: float = 0.0
    failures: list[str] = field(default_factory=list)  # unmet pass criteria

    @property
    def passed(self) -> bool:
        return not self.failures


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _reason(r_status: int, body: bytes) -> str | None:
    """The message of a 4xx error body, or None if it says nothing."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return f"{r_status}: {message}" if isinstance(message, str) and message.strip() else None


async def _one(client: httpx.AsyncClient, url: str, model: str, stream: bool, leave: bool,
               max_tokens: int, seed: int) -> tuple[str, int, str]:
    """(outcome, status, detail) of one completion request."""
    body = {"model": model, "prompt": f"Request {seed}: tell me a story", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                data = await r.aread()
                reason = _reason(r.status_code, data)
                if 400 <= r.status_code < 500 and reason:
                    return "refused", r.status_code, reason
                return "bad", r.status_code, f"{r.status_code}: {data[:300]!r}"
            if not stream:
                data = json.loads(await r.aread())
                ok = bool(data.get("choices"))
                return ("ok" if ok else "bad"), 200, "" if ok else f"200 without choices: {data}"
            done = False
            async for line in r.aiter_lines():
                if leave and line.startswith("data: {"):
                    return "disconnected", 200, ""  # closes the connection mid-stream
                if line.startswith("data: {") and '"error"' in line:
                    return "bad", 200, f"error event in stream: {line[:300]}"
                done = done or line.strip() == "data: [DONE]"
            return ("ok" if done else "bad"), 200, "" if done else "stream ended without [DONE]"
    except httpx.HTTPError as e:
        return "bad", 0, f"transport: {type(e).__name__}: {e}"


async def _drive(url: str, cfg: SoakConfig, dir_names: list[str], churn_paths: dict[str, str],
                 result: SoakResult) -> None:
    rng = random.Random(cfg.seed)
    models = [*dir_names, *churn_paths]
    plan = [(rng.choice(models), rng.random() < cfg.stream_fraction,
             rng.random() < cfg.disconnect_fraction) for _ in range(cfg.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for i, item in enumerate(plan):
        queue.put_nowait((i, *item))
    outcomes, statuses, refusals, churn = Counter(), Counter(), Counter(), Counter()
    clients_done = asyncio.Event()
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0),
                                 limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i, model, stream, leave = queue.get_nowait()
                outcome, status, detail = await _one(client, url, model, stream,
                                                     stream and leave, cfg.max_tokens, i)
                outcomes[outcome] += 1
                statuses[str(status)] += 1
                if outcome == "refused":
                    # one key per kind of refusal: the adapter name varies
                    refusals[detail.replace(model, "<adapter>")] += 1
                elif outcome == "bad" and len(result.bad) < 50:
                    result.bad.append(f"{model}: {detail}")

        def expected_race(kind: str, r: httpx.Response) -> bool:
            """A same-name race's refusal: already loaded, or already gone."""
            if not cfg.same_name_churn:
                return False
            return (kind != "unload" and r.status_code == 400 and
                    "has already been loaded" in r.text) or \
                (kind == "unload" and r.status_code == 404 and "cannot be found" in r.text)

        async def churn_call(kind: str, name: str) -> httpx.Response:
            if kind == "unload":
                r = await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
            else:
                r = await client.post(f"{url}/v1/load_lora_adapter", json={
                    "lora_name": name, "lora_path": churn_paths[name],
                    "load_inplace": kind == "reload"})
            race = expected_race(kind, r)
            churn[f"{kind} {r.status_code}{' race' if race else ''}"] += 1
            if r.status_code != 200 and not race and len(result.bad) < 50:
                result.bad.append(f"churn {kind} {name}: {r.status_code} {r.text[:300]}")
            return r

        async def churner() -> None:
            loaded: set[str] = set()  # as far as this task knows (same-name churn races it)
            crng = random.Random(cfg.seed + 1)
            names = sorted(churn_paths)
            while not clients_done.is_set():
                name = crng.choice(names)
                kind = "unload" if name in loaded else "load"
                r = await churn_call(kind, name)
                if r.status_code == 200 or expected_race(kind, r):
                    loaded.symmetric_difference_update({name})
                await asyncio.sleep(cfg.churn_pause_s)

        async def same_name_churner() -> None:
            crng = random.Random(cfg.seed + 2)
            hot = sorted(churn_paths)[:cfg.same_name_churn]
            while not clients_done.is_set():
                name = crng.choice(hot)
                kinds = ["load", "reload", "unload"]
                crng.shuffle(kinds)
                await asyncio.gather(*(churn_call(k, name) for k in kinds))
                await asyncio.sleep(cfg.churn_pause_s)

        churn_tasks = [asyncio.create_task(churner())]
        if cfg.same_name_churn:
            churn_tasks.append(asyncio.create_task(same_name_churner()))
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        clients_done.set()
        await asyncio.gather(*churn_tasks)
        result.end_state = await _disagreements(client, url)
    result.outcomes, result.statuses = dict(outcomes), dict(statuses)
    result.refusals, result.churn = dict(refusals.most_common()), dict(churn)


async def _disagreements(client: httpx.AsyncClient, url: str) -> list[str]:
    """What `/v1/models`, the adapter listing and the worker's copies
    disagree on, after one more request (its step carries out pending page
    evictions)."""
    await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "end",
                                                     "max_tokens": 1})
    listing = (await client.get(f"{url}/loraserve/v1/adapters")).json()
    ids = [m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]]
    ready = {a["name"] for a in listing["adapters"] if a["status"] == "ready"}
    out = [f"{n} is in /v1/models {ids.count(n)} times" for n in sorted(set(ids))
           if ids.count(n) > 1]
    out += [f"{n} is ready but not in /v1/models" for n in sorted(ready - set(ids))]
    out += [f"{n} is in /v1/models but neither a ready adapter nor an alias of one"
            for n in sorted(set(ids) - ready - {MODEL})
            if not any(r.startswith(f"{n}@") for r in ready)]
    out += [f"orphan on the worker: {o}" for o in listing["orphans"]]
    return out


def _judge(result: SoakResult, cfg: SoakConfig) -> None:
    f = result.failures
    fivexx = sum(n for s, n in result.statuses.items() if s.startswith("5"))
    if fivexx:
        f.append(f"{fivexx} responses with a 5xx status")
    if result.outcomes.get("bad"):
        f.append(f"{result.outcomes['bad']} requests neither answered nor refused with a "
                 "reason")
    bad_churn = sum(n for k, n in result.churn.items()
                    if not k.endswith((" 200", " race")))
    if bad_churn:
        f.append(f"{bad_churn} runtime loads/unloads failed")
    f.extend(f"at the end: {d}" for d in result.end_state)
    if sum(result.outcomes.values()) != cfg.requests:
        f.append(f"{sum(result.outcomes.values())} outcomes for {cfg.requests} requests")
    t_end = result.rss_samples[-1][0] if result.rss_samples else 0.0

    def mean(lo: float, hi: float) -> float:
        xs = [b for t, b in result.rss_samples if lo * t_end <= t <= hi * t_end]
        return sum(xs) / len(xs) if xs else 0.0

    q2, q4 = mean(0.25, 0.5), mean(0.75, 1.0)
    result.rss_q2_mb, result.rss_q4_mb = q2 / 2**20, q4 / 2**20
    result.rss_growth = (q4 - q2) / q2 if q2 else float("inf")
    if result.rss_growth >= cfg.max_rss_growth:
        f.append(f"RSS grew {100 * result.rss_growth:.1f}% from the 2nd to the last quarter "
                 f"(limit {100 * cfg.max_rss_growth:.0f}%)")


def server_args(assets: str, dir_root: str, churn_root: str, cfg: SoakConfig,
                port: int) -> list[str]:
    return [vllm_executable(), "serve", os.path.join(assets, "model"), "--plugin", "loraserve",
            "--served-model-name", MODEL, "--enable-lora", "--max-lora-rank", "128",
            "--max-loras", "8", "--max-num-seqs", str(max(32, cfg.concurrency)),
            "--dtype", "float32", "--max-model-len", "512",
            "--host", "127.0.0.1", "--port", str(port),
            "--loraserve-adapter-dir", dir_root, "--loraserve-allowed-root", churn_root,
            "--loraserve-host-cache-bytes", str(cfg.host_cache_bytes)]


def run_soak(cfg: SoakConfig, workdir: str, progress: bool = False) -> SoakResult:
    """Build the assets, start the server, drive it, stop it by its PID."""
    assets = os.path.join(workdir, "assets")
    build_assets(assets, num_adapters=cfg.adapters)
    names = sorted(os.listdir(os.path.join(assets, "adapters")))
    # The two halves live in two roots: adapter directory, runtime churn.
    dir_root, churn_root = os.path.join(workdir, "dir"), os.path.join(workdir, "churn")
    os.makedirs(dir_root, exist_ok=True)
    os.makedirs(churn_root, exist_ok=True)
    for i, name in enumerate(names):
        dest = os.path.join(dir_root if i % 2 == 0 else churn_root, name)
        if not os.path.exists(dest):
            os.rename(os.path.join(assets, "adapters", name), dest)
    dir_names = sorted(os.listdir(dir_root))
    churn_paths = {n: os.path.join(churn_root, n) for n in sorted(os.listdir(churn_root))}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(server_args(assets, dir_root, churn_root, cfg, port),
                    os.path.join(workdir, "server.log"),
                    {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    result = SoakResult(config=asdict(cfg))
    try:
        server.wait_ready(url, timeout=600, progress=progress)
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                result.rss_samples.append((time.monotonic() - t0, _tree_rss(server.proc.pid)))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        asyncio.run(_drive(url, cfg, dir_names, churn_paths, result))
        result.seconds = time.monotonic() - t0
        stop.set()
        sampler.join()
        if server.proc.poll() is not None:
            result.failures.append(f"the server exited with {server.proc.returncode}")
    finally:
        server.stop()
    _judge(result, cfg)
    return result
