"""`loraserve demo`: the embedded default, end to end on this machine.

Builds the tiny model and adapters, starts `vllm serve ... --plugin loraserve`
on 127.0.0.1, sends concurrent OpenAI requests across every adapter
(completions and chat, one streamed, one to the base model), prints what came
back, and stops the server by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from vllm_loraserve.demo.assets import DEMO_RANKS, build_assets
from vllm_loraserve.process import Server, free_port, vllm_executable

PROMPTS = [
    "Tell me a story about a cat who learned to sail.",
    "Explain how a transformer works to a child.",
    "Write a poem about the sea.",
    "List three colours:",
    "Summarise the following text in one sentence.",
]
@dataclass
class Result:
    model: str
    rank: int | None
    kind: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    text: str
    error: str | None = None


BASE_NAME = "tiny-llama"


def server_command(model_dir: str, adapter_dir: str, port: int) -> list[str]:
    return [
        vllm_executable(), "serve", model_dir, "--served-model-name", BASE_NAME,
        "--plugin", "loraserve", "--loraserve-adapter-dir", adapter_dir,
        "--enable-lora", "--max-lora-rank", str(max(DEMO_RANKS)),
        "--max-loras", "8", "--max-cpu-loras", "32",
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32",
        "--host", "127.0.0.1", "--port", str(port),
    ]


async def _one(client: Any, model: str, rank: int | None, kind: str, prompt: str,
               max_tokens: int) -> Result:
    t0 = time.perf_counter()
    try:
        if kind == "chat":
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, temperature=0)
            text, usage = r.choices[0].message.content or "", r.usage
        elif kind == "stream":
            text, usage = "", None
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage
        else:
            r = await client.completions.create(model=model, prompt=prompt,
                                                max_tokens=max_tokens, temperature=0)
            text, usage = r.choices[0].text, r.usage
        return Result(model, rank, kind, usage.prompt_tokens, usage.completion_tokens,
                      time.perf_counter() - t0, text)
    except Exception as e:  # reported in the table, counted as a failure
        return Result(model, rank, kind, 0, 0, time.perf_counter() - t0, "", str(e)[:200])


async def send_requests(base_url: str, base_model: str, adapters: list[dict[str, Any]],
                        n: int, concurrency: int, max_tokens: int) -> list[Result]:
    """`n` requests round-robin over the adapters (alternating completion and
    chat), the first one streamed and the last one to the base model."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    jobs = []
    for i in range(n):
        a = adapters[i % len(adapters)]
        kind = "stream" if i == 0 else ("chat" if i % 2 else "completion")
        jobs.append((a["name"], a["rank"], kind, PROMPTS[i % len(PROMPTS)]))
    jobs[-1] = (base_model, None, "completion", PROMPTS[0])
    sem = asyncio.Semaphore(concurrency)

    async def bounded(job):
        async with sem:
            return await _one(client, *job, max_tokens)

    results = []
    tasks = [asyncio.create_task(bounded(j)) for j in jobs]
    for t in tqdm(asyncio.as_completed(tasks), total=len(tasks), desc="requests"):
        results.append(await t)
    await client.close()
    return results


def print_table(results: list[Result]) -> None:
    header = f"{'adapter':<22} {'rank':>4} {'kind':<10} {'in':>4} {'out':>4} {'latency':>9}  text"
    print(header)
    print("-" * len(header))
    for r in sorted(results, key=lambda r: (r.rank or 0, r.model, r.kind)):
        rank = "base" if r.rank is None else str(r.rank)
        body = f"ERROR {r.error}" if r.error else json.dumps(r.text.strip()[:40])
        print(f"{r.model[-22:]:<22} {rank:>4} {r.kind:<10} {r.prompt_tokens:>4} "
              f"{r.completion_tokens:>4} {r.latency_s * 1000:>7.0f}ms  {body}")


def run_demo(a: Any) -> int:
    workdir = os.path.abspath(a.workdir)
    assets = os.path.join(workdir, "assets")
    print(f"building the tiny model and {a.num_adapters} adapters in {assets} ...")
    build_assets(assets, num_adapters=a.num_adapters)
    model_dir = os.path.join(assets, "model")
    port = a.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(model_dir, os.path.join(assets, "adapters"), port)
    server = Server(cmd, os.path.join(workdir, "server.log"))
    print("$", server.shell_line())
    print(f"server PID {server.proc.pid}, log {server.log_path}")
    try:
        server.wait_ready(base_url, a.startup_timeout)
        listing = httpx.get(f"{base_url}/loraserve/v1/adapters", timeout=30).json()
        adapters = [x for x in listing["adapters"] if x["status"] == "ready"]
        t0 = time.perf_counter()
        results = asyncio.run(send_requests(base_url, BASE_NAME, adapters, a.requests,
                                            a.concurrency, a.max_tokens))
        wall = time.perf_counter() - t0
        print_table(results)
        after = httpx.get(f"{base_url}/loraserve/v1/adapters", timeout=30).json()
    finally:
        server.stop()
        print(f"server PID {server.proc.pid} stopped (exit code {server.proc.returncode})")

    ok = [r for r in results if r.error is None]
    served = {r.model for r in ok if r.rank is not None}
    ranks = sorted({r.rank for r in ok if r.rank is not None})
    tokens = sum(r.completion_tokens for r in ok)
    print(f"\n{len(ok)}/{len(results)} requests answered in {wall:.1f}s "
          f"({tokens / wall:.0f} generated tok/s); {len(served)} adapters of ranks {ranks}; "
          f"residency after the run: {after['counts']}")
    want = min(20, len(adapters))
    if len(ok) != len(results) or len(served) < want or ranks != sorted(DEMO_RANKS):
        print(f"demo FAILED: expected every request answered by >= {want} adapters "
              f"of ranks {sorted(DEMO_RANKS)}")
        return 1
    return 0
