#!/usr/bin/env python3
"""TTFT of single cold requests, per cold-start mode (issue 24 item 6).

One `vllm serve` per mode in --modes, started with `--loraserve-cold-start
MODE`: bench_e2e.py's Llama-2-7B shape, dummy bf16 weights, vLLM's defaults
otherwise (torch.compile, CUDA graphs) with --max-model-len 4096 (the
model's positions), and the paged pool over PEFT adapters of --ranks
(default 8, 32, 128) on q,k,v,o: one weight set per rank, hard-linked under
as many names as the run needs. Each name is a separate adapter to the
server (its own id, pages and host-tier entry).

For each prompt length L (--prompts), rank r and concurrency N
(--concurrent-cold, default 1), --reps times:
- all-cached: N requests sent together to N adapters of rank r that have
  served a request already (resident in the pool);
- cold: N requests sent together to N names never requested before (in no
  tier of the server: read, checked, packed and written for this request).
Requests are streamed, L random token ids each, --max-tokens output tokens;
one batch at a time. TTFT is the client's: send to first streamed token.
Before each batch the server's adapter listing gives each name's residency;
a request whose adapter was not where its kind needs it (all-cached:
device, cold: disk), or that failed, stays in the records and out of the
medians. An untimed warm-up first sends, at each L, a base-model request,
and per rank one cold request and an all-cached batch per N: Triton
compiles the pool's kernels on their first launches (docs/benchmarks/e2e.md).

"Cold" is cold to the server only: the files lie under --root (default
/dev/shm, memory) and a rank's names share one inode, so their bytes come
from memory, not a disk (benchmarks/cold_start/check_rate.py measures the
disk read).

    python3 benchmarks/cold_start/ttft_bench.py --modes block,pipelined,cpu-assist --out $OUT

Results in --out: ttft-MODE.json (settings, server command and start time,
every request, per-cell medians; rewritten after every cell, `status`
"incomplete" until the mode ends), server-MODE.log, metrics-MODE.txt (the
server's /metrics after its runs) and ttft.json, which combines every
ttft-*.json in --out, also those of earlier runs: one mode per call on one
machine adds up to one table (benchmarks/e2e/device_call.sh cold-start).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import bench_e2e  # noqa: E402  (the model and adapter writers)
import online_ttft  # noqa: E402  (the plugin server's flags)

from vllm_loraserve.bench.replay import (  # noqa: E402
    Outcome,
    served_adapters,
    stream_one,
    token_prompt,
)
from vllm_loraserve.process import Server, free_port, vllm_executable  # noqa: E402

SHAPE = "llama2-7b"
MAX_MODEL_LEN = 4096  # bench_e2e.write_model's max_position_embeddings
SERVE = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
         "--gpu-memory-utilization", "0.9", "--seed", "0", "--served-model-name",
         online_ttft.BASE]
MAX_RANK = 128  # online_ttft.LORA's --max-lora-rank
# Where a measured kind's adapter must be before its batch (the server's listing).
EXPECTED = {"cached": "device", "cold": "disk"}
REQUEST_TIMEOUT_S = 120.0


def log(*a: object) -> None:
    print("[cold-ttft]", *a, flush=True)


def names_per_rank(prompts: list[int], reps: int, concurrent: list[int]) -> int:
    """Names one mode's server uses per rank: the resident ones (the largest
    N), one warm-up cold name per prompt length, and the measured cold ones."""
    return max(concurrent) + len(prompts) * (1 + reps * sum(concurrent))


def names_by_rank(served: dict[str, int], ranks: list[int], needed: int) -> dict[int, list[str]]:
    """The first `needed` served names of each rank, in name order."""
    out = {r: sorted(n for n, rank in served.items() if rank == r)[:needed] for r in ranks}
    short = {r: len(names) for r, names in out.items() if len(names) < needed}
    if short:
        raise RuntimeError(f"the server has too few adapters of ranks {short} (needs {needed} "
                           "each): the names directory was written with another layout")
    return out


def counted(record: dict) -> bool:
    """A measured request that enters the medians: answered, and its adapter
    was where its kind needs it."""
    return (record["error"] is None and record["ttft_s"] is not None
            and record["residency_before"] == EXPECTED[record["kind"]])


def aggregate(records: list[dict]) -> list[dict]:
    """Per (rank, prompt length, concurrency): each kind's requests (`n`),
    those left out (`left_out`: not `counted`) and the median TTFT of the
    rest, and `cold_over_cached`, the ratio of the two medians."""
    groups: dict[tuple[int, int, int], dict[str, list[dict]]] = {}
    for r in records:
        if r["kind"] in EXPECTED:
            key = (r["rank"], r["prompt_len"], r["concurrent"])
            groups.setdefault(key, {k: [] for k in EXPECTED})[r["kind"]].append(r)
    cells = []
    for (rank, length, n), kinds in sorted(groups.items()):
        cell: dict = {"rank": rank, "prompt_len": length, "concurrent": n}
        for kind, group in kinds.items():
            ttfts = [r["ttft_s"] for r in group if counted(r)]
            cell[kind] = {"n": len(group), "left_out": len(group) - len(ttfts),
                          "ttft_s_median": statistics.median(ttfts) if ttfts else None}
        cold, cached = cell["cold"]["ttft_s_median"], cell["cached"]["ttft_s_median"]
        cell["cold_over_cached"] = cold / cached if cold is not None and cached else None
        cells.append(cell)
    return cells


def combine(modes: list[dict]) -> dict:
    """ttft.json from ttft-MODE.json contents: each mode without its
    requests, and every cell as one row (mode, rank, prompt_len, concurrent,
    the two medians, their ratio), in --loraserve-cold-start's order."""
    order = {m: i for i, m in enumerate(online_ttft.COLD_STARTS)}
    modes = sorted(modes, key=lambda m: order.get(m["mode"], len(order)))
    rows = [{"mode": m["mode"], "rank": c["rank"], "prompt_len": c["prompt_len"],
             "concurrent": c["concurrent"], "cached_ttft_s": c["cached"]["ttft_s_median"],
             "cold_ttft_s": c["cold"]["ttft_s_median"], "cold_over_cached": c["cold_over_cached"]}
            for m in modes for c in m.get("cells", [])]
    return {"modes": {m["mode"]: {k: v for k, v in m.items() if k != "requests"} for m in modes},
            "rows": rows}


def table(rows: list[dict]) -> str:
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{1e3 * s:.1f}"

    lines = [f"{'mode':<11} {'rank':>4} {'prompt':>6} {'N':>3} {'cached ms':>10} "
             f"{'cold ms':>10} {'cold/cached':>11}"]
    for r in rows:
        ratio = "-" if r["cold_over_cached"] is None else f"{r['cold_over_cached']:.2f}"
        lines.append(f"{r['mode']:<11} {r['rank']:>4} {r['prompt_len']:>6} {r['concurrent']:>3} "
                     f"{ms(r['cached_ttft_s']):>10} {ms(r['cold_ttft_s']):>10} {ratio:>11}")
    return "\n".join(lines)


# -- one server --------------------------------------------------------------------
async def measure(client: httpx.AsyncClient, url: str, names: dict[int, list[str]],
                  a: argparse.Namespace, records: list[dict],
                  on_cell: Callable[[], None]) -> None:
    """The warm-up and the measured batches (module docstring) against the
    server at `url`, appended to `records`; `on_cell` after each (prompt
    length, rank). `names`: names_by_rank's."""
    rng, vocab = random.Random(a.seed), (4, bench_e2e.SHAPES[SHAPE]["vocab_size"])
    top = max(a.concurrent)
    resident = {r: ns[:top] for r, ns in names.items()}
    fresh = {r: iter(ns[top:]) for r, ns in names.items()}

    async def batch(kind: str, models: list[str], rank: int, length: int, rep: int) -> None:
        listing = (await client.get(f"{url}/loraserve/v1/adapters")).json()["adapters"]
        where = {e["name"]: e.get("residency") for e in listing}
        outs = [Outcome(i, m, m, rank, length, a.max_tokens) for i, m in enumerate(models)]
        prompts = [token_prompt(rng, length, vocab) for _ in models]
        start = time.perf_counter()
        await asyncio.gather(*(stream_one(client, url, o, p, start)
                               for o, p in zip(outs, prompts, strict=True)))
        records.extend({"kind": kind, "model": o.model, "rank": rank, "prompt_len": length,
                        "concurrent": len(models), "rep": rep,
                        "residency_before": where.get(o.model), "ttft_s": o.ttft_s,
                        "e2e_s": o.e2e_s, "error": o.error} for o in outs)

    for r, ns in resident.items():
        for m in ns:
            await batch("warmup", [m], r, min(a.prompts), 0)
    for length in a.prompts:
        await batch("warmup-base", [online_ttft.BASE], 0, length, 0)
        for r in a.ranks:
            await batch("warmup-cold", [next(fresh[r])], r, length, 0)
            for n in a.concurrent:
                await batch("warmup-cached", resident[r][:n], r, length, 0)
    for length in a.prompts:
        for r in a.ranks:
            for n in a.concurrent:
                for rep in range(a.reps):
                    await batch("cached", resident[r][:n], r, length, rep)
                    await batch("cold", [next(fresh[r]) for _ in range(n)], r, length, rep)
            on_cell()


async def measure_server(url: str, names: dict[int, list[str]], a: argparse.Namespace,
                         records: list[dict], on_cell: Callable[[], None]) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        await measure(client, url, names, a, records, on_cell)


def run_mode(mode: str, a: argparse.Namespace, model: str, adapters: str, n_names: int,
             meta: dict) -> dict:
    """One mode's server, warm-up and batches; ttft-MODE.json written after
    every cell and at the end, whatever stopped it (a failed start, an
    error, the time limit's SIGTERM). Returns that JSON's content."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [vllm_executable(), "serve", model, *SERVE, "--host", "127.0.0.1", "--port", str(port),
           *online_ttft.pool_args(adapters, n_names, mode)]
    result: dict = {"mode": mode, "status": "incomplete", **meta, "command": cmd[1:],
                    "requests": []}
    path = os.path.join(a.out, f"ttft-{mode}.json")

    def write() -> None:
        result["cells"] = aggregate(result["requests"])
        json.dump(result, open(path, "w"), indent=1)
        write_combined(a.out)

    server = Server(cmd, os.path.join(a.out, f"server-{mode}.log"))
    try:
        t = time.time()
        server.wait_ready(url, a.start_timeout_s, progress=False)
        result["start_s"] = round(time.time() - t, 1)
        log(f"{mode}: server ready in {result['start_s']} s")
        needed = names_per_rank(a.prompts, a.reps, a.concurrent)
        names = names_by_rank(served_adapters(url), a.ranks, needed)
        asyncio.run(measure_server(url, names, a, result["requests"], write))
        with open(os.path.join(a.out, f"metrics-{mode}.txt"), "w") as f:
            f.write(httpx.get(f"{url}/metrics", timeout=30).text)
        result["status"] = "ok"
    except Exception as e:  # one mode failing must not lose the others' results
        result["status"] = f"failed: {type(e).__name__}: {e}"
        log(f"{mode}: {result['status']}")
    finally:
        server.stop(timeout=5)
        write()
    return result


def write_combined(out: str) -> dict:
    modes = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "ttft-*.json")))]
    combined = combine(modes)
    json.dump(combined, open(os.path.join(out, "ttft.json"), "w"), indent=1)
    return combined


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(online_ttft.COLD_STARTS))
    ap.add_argument("--ranks", type=ints, default=[8, 32, 128])
    ap.add_argument("--prompts", type=ints, default=[128, 512, 2048], help="prompt lengths")
    ap.add_argument("--reps", type=int, default=3, help="batches of each kind per cell")
    ap.add_argument("--concurrent-cold", dest="concurrent", type=ints, default=[1],
                    metavar="N[,N...]",
                    help="requests per batch, N[,N...]: N cold adapters' first requests sent "
                         "together (and N all-cached ones, to compare)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="prompts (the same in every mode)")
    ap.add_argument("--commit", default=os.environ.get("LORASERVE_COMMIT", "unknown"))
    ap.add_argument("--root", default="/dev/shm/loraserve-e2e")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/cold-ttft-out"))
    ap.add_argument("--start-timeout-s", type=float, default=300)
    a = ap.parse_args()
    # A time limit's SIGTERM unwinds through `finally`, which stops the server:
    # it runs in a session of its own, so nothing else would.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = a.modes.split(",")
    if unknown := sorted(set(modes) - set(online_ttft.COLD_STARTS)):
        sys.exit(f"unknown modes {unknown}; choose from {list(online_ttft.COLD_STARTS)}")
    if max(a.ranks) > MAX_RANK or max(a.prompts) + a.max_tokens > MAX_MODEL_LEN:
        sys.exit(f"ranks must be <= {MAX_RANK} and prompt + output <= {MAX_MODEL_LEN} tokens")
    if min(a.concurrent) < 1 or a.reps < 1 or a.max_tokens < 1 or min(a.prompts) < 1:
        sys.exit("--concurrent-cold, --reps, --max-tokens and --prompts must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    shape = bench_e2e.SHAPES[SHAPE]
    ranks = tuple(a.ranks)
    model, adapters = bench_e2e.asset_dirs(a.root, SHAPE, "qkvo", ranks)
    # Name i is weight set i % len(ranks), of rank ranks[i % len(ranks)].
    n_names = len(ranks) * names_per_rank(a.prompts, a.reps, a.concurrent)
    t = time.time()
    bench_e2e.write_model(model, shape)
    bench_e2e.write_adapters(adapters, n_names, shape, bench_e2e.TARGETS["qkvo"][0], ranks,
                             len(ranks))
    log(f"assets ({n_names} adapter names) in {time.time() - t:.1f} s")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout \
        if shutil.which("nvidia-smi") else "no nvidia-smi"
    meta = {"gpu": gpu.strip(), "commit": a.commit, "date": time.strftime("%Y-%m-%d"),
            "shape": SHAPE, "ranks": a.ranks, "prompts": a.prompts, "reps": a.reps,
            "concurrent": a.concurrent, "max_tokens": a.max_tokens, "seed": a.seed}
    for mode in modes:
        result = run_mode(mode, a, model, adapters, n_names, meta)
        log(f"{mode}: {result['status']}")
    print(table(write_combined(a.out)["rows"]), flush=True)


if __name__ == "__main__":
    main()
