"""Step simulation of vLLM V1's scheduler with LoRA adapters paged in the KV
pool (S-LoRA unified paging), comparing the admission orders of
vllm_loraserve.scheduler.admission (the project's code, run as is).

A step schedules the running requests first (chunked prefill, then a token a
step); short of KV pages, it evicts idle adapters, least recently used first,
and only then preempts the newest running request (recompute). If nothing
was preempted, it offers the waiting requests in the policy's order and stops
at the first that does not fit, as vLLM does. Workload: 1000 requests with
prompt and output lengths U[8, 512]; adapter i of n drawn with P ~ 1/(i+1),
of rank (8, 16, 32, 64, 128)[i % 5], holding rank/4 pages of 8 MiB and read
(rank x 2 MiB) in every step it runs; the first min(n, 100) adapters start
resident and idle.

Left out: prefix caching, adapter load time (loads are instant), and any
nonlinearity in step time: a step costs c0 + c1 x tokens + adapter bytes /
(bw x eff), with c0, c1 set per seed so that the no-LoRA run takes the 33.2 s
measured on an H200, half per step and half per token.

Calibration against that H200 run (seeds 100-119): no-LoRA 840 steps (802
measured); FCFS steps over no-LoRA 1.041 / 1.091 / 1.106 at 100 / 1000 / 2000
adapters (1.045 / 1.107 / 1.113 measured).

Usage: python benchmarks/e2e/admission_sim.py --adapters 100,1000,2000
    --policies fcfs,affinity --seeds 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from vllm_loraserve.scheduler.admission import ADMISSIONS

POOL_PAGES = 14139
BLOCK = 16
MAX_SEQS = 1024
TOKEN_BUDGET = 16384
RANKS = (8, 16, 32, 64, 128)
WARM = 100
NO_LORA_S = 33.2
BW = 4.28e12


def rank(lora_id: int) -> int:
    return RANKS[(lora_id - 1) % 5]  # adapter i has lora_int_id i + 1: vLLM's ids start at 1


def adapter_pages(lora_id: int) -> int:
    return rank(lora_id) // 4


@dataclass(eq=False)  # hashed by identity: vLLM's queue removes requests through a set
class Request:
    request_id: str
    lora_request: LoRARequest | None
    prompt: int
    output: int
    generated: int = 0
    computed: int = 0
    pages: int = 0
    preempted: bool = False  # waiting again after a preemption: the scheduler prefers it
    first_step: int = -1  # the step that first admitted it

    @property
    def lora_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request else None

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)  # per step, recomputed ones included
    adapters: list[int] = field(default_factory=list)  # distinct adapters per step
    adapter_bytes: list[int] = field(default_factory=list)  # per step
    pages: list[tuple[int, int, int]] = field(default_factory=list)  # free, KV, adapter
    preemptions: int = 0
    max_passed_over: int = 0  # see count_passes
    generated: list[int] = field(default_factory=list)  # per request, at the end
    first_steps: list[int] = field(default_factory=list)  # per request: its first admission


class Pool:
    """KV and adapter pages in one pool; an adapter that no running request uses
    stays resident (idle) until evicted, least recently used first."""

    def __init__(self, pages: int, n_adapters: int) -> None:
        warm = range(1, min(n_adapters, WARM) + 1)
        self.free = pages - sum(map(adapter_pages, warm))
        self.users: dict[int, int] = {}  # lora id -> running requests
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(warm)

    def in_use(self, lora_id: int) -> bool:
        return self.users.get(lora_id, 0) > 0

    def adapter_pages(self) -> int:
        return sum(map(adapter_pages, [*self.idle, *filter(self.in_use, self.users)]))

    def load(self, lora_id: int | None) -> int:
        if lora_id is None or lora_id in self.idle or self.in_use(lora_id):
            return 0
        return adapter_pages(lora_id)

    def make_room(self, pages: int) -> bool:
        while self.free < pages and self.idle:
            self.free += adapter_pages(self.idle.popitem(last=False)[0])
        return self.free >= pages

    def fits(self, kv: int, lora_id: int | None) -> bool:
        # The request's own adapter is pinned before anything is evicted.
        evictable = sum(adapter_pages(i) for i in self.idle if i != lora_id)
        return kv + self.load(lora_id) <= self.free + evictable

    def take(self, kv: int, lora_id: int | None) -> None:
        """Pin the adapter, loading it if absent, and take `kv` pages (they fit)."""
        pages = kv + self.load(lora_id)
        if lora_id is not None:
            self.idle.pop(lora_id, None)
            self.users[lora_id] = self.users.get(lora_id, 0) + 1
        self.make_room(pages)
        self.free -= pages

    def drop(self, r: Request) -> None:
        """Free a request's KV pages and unpin its adapter."""
        self.free += r.pages
        r.pages = 0
        if r.lora_id is not None:
            self.users[r.lora_id] -= 1
            if not self.users[r.lora_id]:
                self.idle[r.lora_id] = None


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def workload(n_requests: int, n_adapters: int, seed: int) -> list[Request]:
    # Lengths are drawn before adapters: the no-LoRA run of a seed serves the same ones.
    rng = np.random.default_rng(seed)
    prompts = rng.integers(8, 513, n_requests)
    outputs = rng.integers(8, 513, n_requests)
    loras: list[LoRARequest | None] = [None] * n_requests
    if n_adapters:
        p = 1.0 / np.arange(1, n_adapters + 1)
        ids = rng.choice(n_adapters, n_requests, p=p / p.sum()) + 1
        loras = [LoRARequest(f"a{i}", int(i), f"/a{i}") for i in ids]
    return [Request(str(i), loras[i], int(prompts[i]), int(outputs[i]))
            for i in range(n_requests)]


def schedule_running(running: list[Request], waiting: Any,
                     pool: Pool) -> tuple[list[tuple[Request, int]], int, int]:
    """vLLM's first pass; returns the batch, the token budget left and the preemptions."""
    batch: list[tuple[Request, int]] = []
    budget, preempted = TOKEN_BUDGET, 0
    for r in running:  # the list shrinks from the end only, behind r
        if budget <= 0:
            break
        n = min(r.num_tokens - r.computed, budget)
        need = blocks(r.computed + n) - r.pages
        while not pool.make_room(need):
            victim = running.pop()
            pool.drop(victim)
            victim.computed, victim.preempted = 0, True
            waiting.prepend_request(victim)
            preempted += 1
            if victim is r:
                return batch, budget, preempted
        pool.free -= need
        r.pages += need
        batch.append((r, n))
        budget -= n
    return batch, budget, preempted


def admit(waiting: Any, running: list[Request], pool: Pool, budget: int,
          batch: list[tuple[Request, int]], step: int) -> set[Request]:
    """vLLM's second pass, over the queue in the order the policy left it."""
    admitted: set[Request] = set()
    while waiting and len(running) < MAX_SEQS and budget > 0:
        r = waiting.peek_request()
        n = min(r.num_tokens, budget)
        if not pool.fits(blocks(n), r.lora_id):
            break
        waiting.pop_request()
        pool.take(blocks(n), r.lora_id)
        r.pages, r.preempted = blocks(n), False
        if r.first_step < 0:
            r.first_step = step
        running.append(r)
        batch.append((r, n))
        budget -= n
        admitted.add(r)
    return admitted


def count_passes(queue: list[Request], admitted: set[Request], passes: dict[str, int]) -> int:
    """Counts, per waiting request, the steps in which one behind it in the queue
    was admitted and it was not (an admitted one starts again); returns the most."""
    last = max((i for i, r in enumerate(queue) if r in admitted), default=0)
    for r in queue[:last]:
        if r not in admitted:
            passes[r.request_id] = passes.get(r.request_id, 0) + 1
    for r in admitted:
        passes.pop(r.request_id, None)
    return max(passes.values(), default=0)


def execute(batch: list[tuple[Request, int]], running: list[Request], pool: Pool,
            run: Run) -> None:
    loras = {r.lora_id for r, _ in batch if r.lora_id is not None}
    run.tokens.append(sum(n for _, n in batch))
    run.adapters.append(len(loras))
    run.adapter_bytes.append(sum(rank(i) * 2 * 2**20 for i in loras))
    for r, n in batch:
        r.computed += n
        r.generated += r.computed == r.num_tokens
        if r.generated == r.output:
            pool.drop(r)
    running[:] = [r for r in running if r.generated < r.output]


def simulate(n_adapters: int, seed: int, policy: str = "fcfs", n_requests: int = 1000,
             pool_pages: int = POOL_PAGES, max_steps: int = 100_000) -> Run:
    requests = workload(n_requests, n_adapters, seed)
    waiting = create_request_queue(SchedulingPolicy.FCFS)
    for r in requests:
        waiting.add_request(r)
    admission = ADMISSIONS[policy]()
    pool = Pool(pool_pages, n_adapters)
    running: list[Request] = []
    passes: dict[str, int] = {}
    run = Run()
    while waiting or running:
        if len(run.tokens) == max_steps:
            raise RuntimeError(f"not done in {max_steps} steps")
        batch, budget, preempted = schedule_running(running, waiting, pool)
        run.preemptions += preempted
        if not preempted:  # as vLLM: no admissions in a step that preempted
            queue = list(waiting)
            waiting_ids = {r.request_id for r in queue}
            admission.order(waiting, lambda r: r.lora_id is None or pool.in_use(r.lora_id)
                            or r.preempted, waiting_ids.__contains__, SchedulingPolicy.FCFS)
            admitted = admit(waiting, running, pool, budget, batch, len(run.tokens))
            run.max_passed_over = max(run.max_passed_over,
                                      count_passes(queue, admitted, passes))
        run.pages.append((pool.free, sum(r.pages for r in running), pool.adapter_pages()))
        execute(batch, running, pool, run)
    run.generated = [r.generated for r in requests]
    run.first_steps = [r.first_step for r in requests]
    return run


def metrics(run: Run, no_lora: Run, eff: float) -> dict[str, float]:
    c0 = 0.5 * NO_LORA_S / len(no_lora.tokens)
    c1 = 0.5 * NO_LORA_S / sum(no_lora.tokens)
    seconds = c0 * len(run.tokens) + c1 * sum(run.tokens) + sum(run.adapter_bytes) / (BW * eff)
    return {"steps": len(run.tokens),
            "steps/no-LoRA": len(run.tokens) / len(no_lora.tokens),
            "adapters/step": float(np.mean(run.adapters)),
            "adapter_GB": sum(run.adapter_bytes) / 1e9,
            "preemptions": run.preemptions,
            # When requests start: what the reordering costs the ones it passes over.
            "first_step_p50": float(np.percentile(run.first_steps, 50)),
            "first_step_p99": float(np.percentile(run.first_steps, 99)),
            "throughput/no-LoRA": NO_LORA_S / seconds}


def digits(x: float) -> int:
    return 3 if abs(x) < 10 else 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default="100,1000,2000")
    ap.add_argument("--policies", default="fcfs,affinity")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eff", type=float, default=0.4, help="share of bw that adapter reads get")
    ap.add_argument("--out", default="results.json")
    args = ap.parse_args(argv)
    policies, seeds = args.policies.split(","), range(args.seeds)
    no_lora = [simulate(0, s) for s in seeds]
    results: dict[str, Any] = {"no_lora_steps": [len(r.tokens) for r in no_lora]}
    print(f"no-LoRA steps {np.mean(results['no_lora_steps']):.1f}; mean over {args.seeds} "
          "seeds (paired change vs fcfs)")
    for n in map(int, args.adapters.split(",")):
        runs = {p: [metrics(simulate(n, s, p), no_lora[s], args.eff) for s in seeds]
                for p in dict.fromkeys(["fcfs", *policies])}  # fcfs: the paired baseline
        for p in policies:
            pairs = list(zip(runs[p], runs["fcfs"], strict=True))
            row = {k: (float(np.mean([m[k] for m, _ in pairs])),
                       float(np.mean([m[k] - f[k] for m, f in pairs]))) for k in runs[p][0]}
            results[f"{n}/{p}"] = {"mean_and_delta": row, "per_seed": runs[p]}
            print(f"adapters={n} {p:8s} " + "  ".join(
                f"{k} {m:.{digits(m)}f} ({d:+.{digits(m)}f})" for k, (m, d) in row.items()))
    results["model"] = {"bw": BW, "eff": args.eff, "no_lora_s": NO_LORA_S, "seeds": args.seeds}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
