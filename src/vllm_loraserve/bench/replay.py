"""Replay a trace against any OpenAI-compatible endpoint (vllm serve, the
router) and measure what clients see.

Open loop: request i is sent at `arrival_s / time_scale` after the start,
whatever is still in flight. Prompts are `prompt_len` random token ids (the
completions API takes token ids, so lengths are exact); `max_tokens =
output_len` with `ignore_eos`, streamed, so:

- TTFT: send to the first streamed token;
- TPOT: (last token - first token) / (tokens - 1), per request, the
  definition of vLLM's `vllm:request_time_per_output_token_seconds`;
- TBT: every gap between streamed tokens;
- E2E: send to the end of the stream.

Trace adapter names are mapped to served model names: identity, an explicit
map, or by rank (each trace adapter gets a served adapter of the same rank,
round-robin over the served ones in name order).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from vllm_loraserve.workloads.trace import Request


@dataclass
class Outcome:
    request_id: int
    adapter: str  # the trace's name
    model: str  # the served name it was sent as
    rank: int
    prompt_len: int
    output_len: int
    sent_s: float = 0.0  # from the start of the replay
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    tbt_s: list[float] = field(default_factory=list)
    error: str | None = None


def served_adapters(base_url: str) -> dict[str, int]:
    """Served adapter name -> rank, from the adapter listing a plugin server
    and the router both serve."""
    r = httpx.get(f"{base_url}/loraserve/v1/adapters", timeout=30)
    r.raise_for_status()
    return {a["name"]: a["rank"] for a in r.json()["adapters"] if a["status"] == "ready"}


def map_by_rank(trace: Sequence[Request], served: Mapping[str, int]) -> dict[str, str]:
    by_rank: dict[int, list[str]] = defaultdict(list)
    for name, rank in sorted(served.items()):
        by_rank[rank].append(name)
    mapping, used = {}, defaultdict(int)
    for req in trace:
        if req.adapter in mapping:
            continue
        names = by_rank.get(req.rank)
        if not names:
            raise ValueError(f"the server has no adapter of rank {req.rank} "
                             f"(it serves ranks {sorted(by_rank)})")
        mapping[req.adapter] = names[used[req.rank] % len(names)]
        used[req.rank] += 1
    return mapping


def token_prompt(rng: random.Random, length: int, vocab: tuple[int, int]) -> list[int]:
    """`length` random token ids in [vocab[0], vocab[1]): a prompt of exactly
    that many tokens (no tokenizer on the way)."""
    return [rng.randrange(*vocab) for _ in range(length)]


async def stream_one(client: httpx.AsyncClient, base_url: str, out: Outcome, prompt: list[int],
                     start: float) -> None:
    """Send one streamed completion and fill `out`'s timings (or its error);
    `start` is the clock reading `out.sent_s` counts from."""
    body = {"model": out.model, "prompt": prompt, "max_tokens": out.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out.sent_s = t0 - start
    token_times: list[float] = []
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    token_times.append(time.perf_counter())
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    end = time.perf_counter()
    out.e2e_s = end - t0
    if token_times:
        out.ttft_s = token_times[0] - t0
        out.tbt_s = np.diff(token_times).tolist()
        if out.output_tokens > 1:
            out.tpot_s = (token_times[-1] - token_times[0]) / (out.output_tokens - 1)


async def replay(trace: Sequence[Request], base_url: str, *, model_for: Callable[[Request], str],
                 time_scale: float = 1.0, vocab: tuple[int, int] = (10, 200), seed: int = 0,
                 timeout_s: float = 600.0, progress: bool = True) -> list[Outcome]:
    from tqdm import tqdm

    rng = random.Random(seed)
    prompts = [token_prompt(rng, r.prompt_len, vocab) for r in trace]
    outcomes = [Outcome(r.request_id, r.adapter, model_for(r), r.rank, r.prompt_len,
                        r.output_len) for r in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        bar = tqdm(total=len(trace), desc="replay", disable=not progress)
        start = time.perf_counter()

        async def fire(i: int) -> None:
            delay = trace[i].arrival_s / time_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await stream_one(client, base_url, outcomes[i], prompts[i], start)
            bar.update(1)

        await asyncio.gather(*(fire(i) for i in range(len(trace))))
        bar.close()
    return outcomes


def _pct(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    v = np.asarray(values)
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p95": float(np.percentile(v, 95)), "p99": float(np.percentile(v, 99))}


def summarize(outcomes: Sequence[Outcome], *, slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict:
    """Overall numbers and the same per adapter and per rank."""
    def block(group: Sequence[Outcome]) -> dict:
        ok = [o for o in group if o.error is None and o.ttft_s is not None]
        out = {"requests": len(group), "errors": len(group) - len(ok),
               "ttft_s": _pct([o.ttft_s for o in ok]),
               "tpot_s": _pct([o.tpot_s for o in ok if o.tpot_s is not None]),
               "e2e_s": _pct([o.e2e_s for o in ok])}
        if slo_ttft_s is not None or slo_tpot_s is not None:
            met = [o for o in ok if (slo_ttft_s is None or o.ttft_s <= slo_ttft_s)
                   and (slo_tpot_s is None or o.tpot_s is None or o.tpot_s <= slo_tpot_s)]
            out["slo_attainment"] = len(met) / max(1, len(group))
        return out

    ok = [o for o in outcomes if o.error is None and o.e2e_s is not None]
    span = max((o.sent_s + o.e2e_s for o in ok), default=0.0)
    summary = block(outcomes)
    summary.update({
        "duration_s": span,
        "throughput_req_s": len(ok) / span if span else 0.0,
        "throughput_output_tok_s": sum(o.output_tokens for o in ok) / span if span else 0.0,
        "tbt_s": _pct([t for o in ok for t in o.tbt_s]),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "per_rank": {str(r): block([o for o in outcomes if o.rank == r])
                     for r in sorted({o.rank for o in outcomes})},
        "per_adapter": {a: block([o for o in outcomes if o.adapter == a])
                        for a in sorted({o.adapter for o in outcomes})},
    })
    return summary


def first_and_later(outcomes: Sequence[Outcome]) -> dict:
    """TTFT of each served adapter's first request, apart from the later ones.

    `first`: the earliest-sent request of each served name (`model`), the one
    that finds its adapter in no tier of a server started empty; `later`:
    every other request, also one sent while the first still waited for the
    load. `n` counts requests; `errors` those without a TTFT, which the
    percentiles leave out."""
    first: dict[str, int] = {}
    for i in sorted(range(len(outcomes)), key=lambda i: outcomes[i].sent_s):
        first.setdefault(outcomes[i].model, i)
    firsts = set(first.values())

    def block(group: list[Outcome]) -> dict:
        ttfts = [o.ttft_s for o in group if o.error is None and o.ttft_s is not None]
        return {"n": len(group), "errors": len(group) - len(ttfts), "ttft_s": _pct(ttfts)}

    return {"first": block([o for i, o in enumerate(outcomes) if i in firsts]),
            "later": block([o for i, o in enumerate(outcomes) if i not in firsts])}


def save(path: str, outcomes: Sequence[Outcome], summary: dict, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "summary": summary,
                   "requests": [asdict(o) for o in outcomes]}, f, indent=1)
