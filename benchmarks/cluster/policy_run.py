"""Issue 25 item 5: the placement policies through the router on live engines.

For each policy: `loraserve cluster up` (its own process), wait for the
router, replay one `loraserve bench gen --kind loraserve --popularity
shifting` trace per rate through it (`loraserve bench replay --map-by-rank`),
read the router's /metrics before and after each replay (migrations,
fetches and bytes moved, retries) and its /admin/status (placement), then
stop the cluster (SIGINT to its process, then any engine server still alive
by the PID the router listed). One JSON holds everything, with each command
line, the device, date and commit (env LORASERVE_COMMIT).

    # one H200, 2 engines sharing it, Llama-2-7B shape (dummy weights), 100 adapters
    python3 benchmarks/cluster/policy_run.py --device cuda --engines 2 --engines-per-gpu 2 \\
        --policies loraserve,toppings,random,contiguous --rates 2,4,8 --budget-s 520 \\
        --out $OUT/policies.json
    # CPU smoke: tiny demo model and adapters (`loraserve demo-assets DIR`)
    python benchmarks/cluster/policy_run.py --device cpu --model DIR/model \\
        --adapters DIR/adapters --engines 2 --policies loraserve,random --rates 0.5 \\
        --duration-s 8 --num-adapters 6 --input-range 8,64 --output-range 8,32 \\
        --serve-args "--dtype float32 --max-model-len 512 --max-loras 8 --max-num-seqs 32"

The cluster stays up across the rates of one policy, in the order given: the
router's demand estimate carries over from one rate to the next, as in a
service whose load rises. `--budget-s` bounds the whole run: a policy or a
rate that would not fit in what is left is skipped, and the JSON says so.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
LORASERVE = [sys.executable, "-m", "vllm_loraserve.cli.main"]
# GPU engines: bench_e2e.py's settings (dummy weights, bf16, max_model_len 2048,
# vLLM's defaults otherwise: torch.compile and CUDA graphs).
CUDA_SERVE_ARGS = "--load-format dummy --dtype bfloat16 --max-model-len 2048"
COUNTERS = ("loraserve_router_migrations_total", "loraserve_router_fetches_total",
            "loraserve_router_fetch_bytes_total", "loraserve_router_retries_total",
            "loraserve_router_requests_total")


def cluster_command(a: argparse.Namespace, policy: str, port: int, workdir: str) -> list[str]:
    """`loraserve cluster up` for one policy (a pure function of the options)."""
    cmd = [*LORASERVE, "cluster", "up", "--model", a.model, "--adapters", a.adapters,
           "--served-model-name", "base", "--policy", policy, "--engines", str(a.engines),
           "--device", a.device, "--port", str(port), "--workdir", workdir,
           "--rebalance-s", str(a.rebalance_s), "--transport", a.transport,
           "--serve-args", a.serve_args]
    if a.device == "cuda":
        cmd += ["--engines-per-gpu", str(a.engines_per_gpu)]
        if a.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    return cmd


def gen_command(a: argparse.Namespace, rate: float, out: str) -> list[str]:
    return [*LORASERVE, "bench", "gen", "--kind", "loraserve", "--popularity", "shifting",
            "--num-adapters", str(a.num_adapters), "--rate", str(rate),
            "--duration", str(a.duration_s), "--seed", str(a.seed),
            "--input-range", a.input_range, "--output-range", a.output_range, "--out", out]


def replay_command(trace: str, url: str, out: str) -> list[str]:
    return [*LORASERVE, "bench", "replay", "--trace", trace, "--url", url, "--out", out,
            "--map-by-rank"]


def counters(text: str) -> dict[str, float]:
    """The router's counters of interest, keyed `name{label=value,...}`."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "adapter")
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict:
    """What one replay did to the router: migrations, fetches and bytes by
    source, retries, requests by status."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def by(name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in d.items():
            if k.startswith(name + "{"):
                value = dict(p.split("=", 1) for p in k[len(name) + 1:-1].split(",") if p)
                out[value[label]] = out.get(value[label], 0.0) + v
        return out

    return {"migrations": d.get("loraserve_router_migrations_total{}", 0.0),
            "fetches": by("loraserve_router_fetches_total", "source"),
            "bytes_moved": by("loraserve_router_fetch_bytes_total", "source"),
            "retries": d.get("loraserve_router_retries_total{}", 0.0),
            "requests": by("loraserve_router_requests_total", "status")}


def placement_summary(status: dict) -> dict:
    return {"adapters_per_engine": {e: len(v["adapters"]) for e, v in status["engines"].items()},
            "split_adapters": sum(len(v) > 1 for v in status["placement"].values()),
            "alive": status["alive"]}


def replay_summary(path: str) -> dict:
    s = json.load(open(path))["summary"]
    keep = ("requests", "errors", "duration_s", "throughput_req_s", "throughput_output_tok_s")
    return {**{k: s[k] for k in keep}, "ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"],
            "per_rank_ttft_p95_s": {r: b["ttft_s"].get("p95") for r, b in s["per_rank"].items()}}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or platform.processor()
    except (OSError, subprocess.TimeoutExpired):
        return f"cpu: {platform.machine()}, {os.cpu_count()} cores"


def _free_port() -> int:
    from vllm_loraserve.process import free_port

    return free_port()


def cuda_assets(root: str, num_adapters: int, distinct: int) -> tuple[str, str]:
    """bench_e2e.py's Llama-2-7B shape (dummy weights) and `num_adapters`
    names hard-linked to `distinct` weight sets of ranks 8..128 over q,k,v,o."""
    sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
    import bench_e2e as e2e

    model, adapters = e2e.asset_dirs(root, "llama2-7b", "qkvo", e2e.DEFAULT_RANKS)
    e2e.write_model(model, e2e.SHAPES["llama2-7b"])
    e2e.write_adapters(adapters, num_adapters, e2e.SHAPES["llama2-7b"], e2e.TARGETS["qkvo"][0],
                       e2e.DEFAULT_RANKS, distinct)
    return model, os.path.join(adapters, "names")


def _wait_ready(proc: subprocess.Popen, url: str, budget: Budget, reserve: float) -> str | None:
    """None once the router answers /health 200, else why not."""
    while budget.left() > reserve:
        if proc.poll() is not None:
            return f"`cluster up` exited with {proc.returncode} before the router was up"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return "the budget ran out before the router was up"


def _stop(proc: subprocess.Popen, engine_pids: list[int], timeout: float) -> dict:
    """SIGINT to `cluster up` (it stops the router, engines and Ray), then
    SIGKILL what is left: its process group, engine servers by PID."""
    t0 = time.monotonic()
    forced = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            forced.append(f"cluster up {proc.pid}")
    for pid in engine_pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)  # a server runs in a session of its own
        except ProcessLookupError:
            os.kill(pid, signal.SIGKILL)
        forced.append(f"engine server {pid}")
    return {"stop_s": round(time.monotonic() - t0, 1), "exit": proc.returncode,
            "killed": forced}


def run_policy(a: argparse.Namespace, policy: str, traces: dict[float, str], budget: Budget,
               result: dict, save) -> None:
    rec: dict = {"rates": {}}
    result["policies"][policy] = rec
    workdir = os.path.join(a.workdir, policy)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = cluster_command(a, policy, port, workdir)
    rec["command"] = shlex.join(cmd)
    os.makedirs(workdir, exist_ok=True)
    log = open(os.path.join(workdir, "cluster-up.log"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine_pids: list[int] = []
    try:
        why = _wait_ready(proc, url, budget, a.stop_reserve_s + a.duration_s)
        rec["start_s"] = round(time.monotonic() - t0, 1)
        if why:
            rec["status"] = f"not started: {why} (log: {log.name})"
            return
        status = httpx.get(f"{url}/admin/status", timeout=30).json()
        engine_pids = [v["pid"] for v in status["engines"].values() if v["pid"]]
        rec["placement_at_start"] = placement_summary(status)
        for rate, trace in traces.items():
            need = a.duration_s + a.drain_s + a.stop_reserve_s
            if budget.left() < need:
                rec["rates"][str(rate)] = {"status": f"skipped: {budget.left():.0f} s left, "
                                           f"needs about {need:.0f} s"}
                continue
            out = os.path.join(workdir, f"replay-{rate}.json")
            before = counters(httpx.get(f"{url}/metrics", timeout=30).text)
            t1 = time.monotonic()
            replay = replay_command(trace, url, out)
            run: dict = {"command": shlex.join(replay)}
            rec["rates"][str(rate)] = run
            try:
                rc = subprocess.run(replay, capture_output=True, text=True,
                                    timeout=budget.left() - a.stop_reserve_s)
                run["status"] = "ok" if rc.returncode == 0 else f"failed ({rc.returncode})"
                run["output"] = (rc.stdout + rc.stderr)[-1500:]
            except subprocess.TimeoutExpired:
                run["status"] = "cut: the budget ran out during the replay"
            run["wall_s"] = round(time.monotonic() - t1, 1)
            if os.path.exists(out):
                run.update(replay_summary(out))
            run["router"] = moved(before, counters(httpx.get(f"{url}/metrics", timeout=30).text))
            run["placement_after"] = placement_summary(
                httpx.get(f"{url}/admin/status", timeout=30).json())
            save()
        rec["status"] = "ok"
    finally:
        rec["stop"] = _stop(proc, engine_pids, a.stop_reserve_s)
        log.close()
        # the engines' copies of the adapters (GBs on the 7B shape), not the logs
        for d in glob.glob(os.path.join(workdir, "engine-*", "adapters")):
            shutil.rmtree(d, ignore_errors=True)
        save()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--model", help="model directory (default on cuda: the Llama-2-7B shape)")
    ap.add_argument("--adapters", help="adapters directory (default on cuda: --num-adapters "
                    "hard-linked adapters)")
    ap.add_argument("--assets-root", default="/dev/shm/loraserve-e2e",
                    help="cuda: where the model and adapters are written")
    ap.add_argument("--distinct", type=int, default=10,
                    help="cuda: distinct weight sets behind the adapter names (a multiple of 5 "
                    "keeps name i at rank 8..128 [i %% 5])")
    ap.add_argument("--num-adapters", type=int, default=100)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--engines-per-gpu", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--policies", default="loraserve,toppings,random,contiguous")
    ap.add_argument("--rates", default="2,4,8", help="requests per second, one trace each")
    ap.add_argument("--duration-s", type=float, default=20.0, help="each trace's length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-range", default="8,512",
                    help="prompt tokens LO,HI (HI excluded): keep HI + output HI within the "
                    "engines' --max-model-len")
    ap.add_argument("--output-range", default="8,512", help="output tokens LO,HI")
    ap.add_argument("--rebalance-s", type=float, default=5.0,
                    help="the router's placement period (the skew shifts within a trace)")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--serve-args", default=None,
                    help=f"engine `vllm serve` arguments (cuda default: {CUDA_SERVE_ARGS!r})")
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--drain-s", type=float, default=20.0,
                    help="allowance past a trace's end for its last requests")
    ap.add_argument("--stop-reserve-s", type=float, default=45.0,
                    help="kept for stopping a cluster")
    ap.add_argument("--workdir", default="/tmp/loraserve-policy-run")
    ap.add_argument("--out", required=True, help="results JSON")
    a = ap.parse_args()
    budget = Budget(a.budget_s)
    if a.serve_args is None:
        a.serve_args = CUDA_SERVE_ARGS if a.device == "cuda" else ""
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]),
                    "device": _device(), "date": datetime.datetime.now(datetime.UTC).isoformat(
                        timespec="seconds"),
                    "commit": os.environ.get("LORASERVE_COMMIT", "unknown"),
                    "budget_s": a.budget_s, "policies": {}}
    os.makedirs(a.workdir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save() -> None:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    if a.model is None or a.adapters is None:
        if a.device != "cuda":
            sys.exit("--device cpu needs --model and --adapters (e.g. `loraserve demo-assets`)")
        t = time.monotonic()
        a.model, a.adapters = cuda_assets(a.assets_root, a.num_adapters, a.distinct)
        result["assets_s"] = round(time.monotonic() - t, 1)
        result["shape"] = "llama2-7b (dummy weights), adapters on q,k,v,o"
    result.update(model=a.model, adapters=a.adapters)
    traces, result["traces"] = {}, {}
    for rate in (float(r) for r in a.rates.split(",")):
        path = os.path.join(a.workdir, f"trace-{rate}.jsonl")
        cmd = gen_command(a, rate, path)
        subprocess.run(cmd, check=True, capture_output=True)
        traces[rate] = path
        result["traces"][str(rate)] = shlex.join(cmd)
    save()
    for policy in a.policies.split(","):
        # at least a start and one rate: the start is guessed from the last one
        started = [p.get("start_s") for p in result["policies"].values() if "start_s" in p]
        need = (started[-1] if started else 60.0) + a.duration_s + a.drain_s + a.stop_reserve_s
        if budget.left() < need:
            result["policies"][policy] = {"status": f"skipped: {budget.left():.0f} s left, "
                                          f"needs about {need:.0f} s"}
            save()
            continue
        print(f"[policy_run] {policy}: starting the cluster ({budget.left():.0f} s left)",
              flush=True)
        run_policy(a, policy, traces, budget, result, save)
        print(f"[policy_run] {policy}: {json.dumps(_line(result['policies'][policy]))}",
              flush=True)
    save()
    # 1: a policy or rate did not run, or a request failed (the JSON says which)
    runs = [r for p in result["policies"].values() for r in p.get("rates", {}).values()]
    return 0 if (all(p.get("status") == "ok" for p in result["policies"].values())
                 and all(r.get("status") == "ok" and not r.get("errors") for r in runs)) else 1


def _line(rec: dict) -> dict:
    """A policy's results in a line: TTFT p95 and throughput per rate."""
    return {"status": rec.get("status"), "start_s": rec.get("start_s"),
            **{r: (f"{v['requests']} requests, {v['errors']} errors, "
                   f"{v['ttft_s'].get('p95', float('nan')):.3f}s p95 TTFT, "
                   f"{v['throughput_output_tok_s']:.0f} tok/s, "
                   f"{v['router']['migrations']:.0f} migrations"
                   if "ttft_s" in v else v.get("status"))
               for r, v in rec.get("rates", {}).items()}}


if __name__ == "__main__":
    sys.exit(main())
