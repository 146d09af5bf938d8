#!/usr/bin/env python3
"""Talk to `vllm serve MODEL --plugin loraserve ...` with the OpenAI client:
adapters are models. Lists the served adapters (with where each resides),
completes with one adapter and with the base model, and streams a chat.

    # GiB of KV cache on vLLM's CPU build (without it: 92% of the machine's
    # memory, which fails next to anything else); vLLM on a GPU ignores it
    VLLM_CPU_KVCACHE_SPACE=1 vllm serve MODEL --plugin loraserve --enable-lora \\
        --max-lora-rank 128 --loraserve-adapter-dir ADAPTERS \\
        --host 127.0.0.1 --port 8000
    python examples/openai_client.py --url http://127.0.0.1:8000 --adapter NAME
"""

from __future__ import annotations

import argparse

import httpx
import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ap.add_argument("--adapter", help="adapter to use (default: the first one listed)")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="unused")

    # The plugin's adapter listing: rank, targets, residency (disk/host/device), pages.
    adapters = httpx.get(f"{a.url}/loraserve/v1/adapters", timeout=30).json()["adapters"]
    ready = [x for x in adapters if x["status"] == "ready"]
    for x in adapters:
        print(f"{x['name']:<24} {x['status']:<8} rank {x.get('rank', '-'):<4} "
              f"{x.get('residency', x.get('error', ''))}")
    if not ready:
        raise SystemExit("the server lists no servable adapter")
    adapter = a.adapter or ready[0]["name"]
    base = next(m.id for m in client.models.list().data
                if m.id not in {x["name"] for x in adapters})

    for model in (adapter, base):
        out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                        temperature=0)
        print(f"[{model}] {out.choices[0].text!r} ({out.usage.completion_tokens} tokens)")

    print(f"[{adapter}, streamed] ", end="", flush=True)
    stream = client.chat.completions.create(
        model=adapter, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
        temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    listed = httpx.get(f"{a.url}/loraserve/v1/adapters/{adapter}", timeout=30).json()
    print(f"{adapter} now resides on: {listed['residency']} ({listed['device_type']}, "
          f"{listed.get('pages')} pages)")


if __name__ == "__main__":
    main()
