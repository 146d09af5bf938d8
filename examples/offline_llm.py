#!/usr/bin/env python3
"""Offline inference with the plugin: vLLM's `LLM`, turned on by the
`loraserve` key of `additional_config` (the same settings as the
`--loraserve-*` flags). Every adapter of a directory in one batch, with one
vLLM LoRA slot: the paged pool has no slot cap.

    python examples/offline_llm.py --model MODEL --adapters ADAPTERS_DIR
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", required=True, help="a directory of PEFT adapter folders")
    ap.add_argument("--max-tokens", type=int, default=12)
    a = ap.parse_args()

    # vLLM's CPU backend otherwise reserves 92% of the machine's memory for
    # its KV cache and fails to start next to anything else (GiB; a GPU
    # ignores it). vLLM reads it when the engine starts: set it before.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    names = sorted(n for n in os.listdir(a.adapters)
                   if os.path.isdir(os.path.join(a.adapters, n)))
    llm = LLM(model=a.model, enable_lora=True, max_lora_rank=128, max_loras=1,
              max_model_len=256,
              additional_config={"loraserve": {"host_cache_bytes": 1 << 30}})
    loras = [LoRARequest(n, i + 1, os.path.join(a.adapters, n)) for i, n in enumerate(names)]
    outs = llm.generate(["Once upon a time"] * (len(loras) + 1),
                        SamplingParams(max_tokens=a.max_tokens, temperature=0),
                        lora_request=[*loras, None], use_tqdm=False)
    for name, out in zip([*names, "(base model)"], outs, strict=True):
        print(f"{name:<24} {out.outputs[0].text!r}")
    pool = llm.collective_rpc("loraserve_residency")[0]["pool"]
    print(f"{pool['peak_batch_adapters']} adapters in one batch; "
          f"{pool['adapter_pages']} of {pool['total_pages']} KV pages hold adapters")


if __name__ == "__main__":
    main()
