"""Run one vLLM engine on a batch and dump greedy tokens and logprobs (JSON).

    python vllm_generate.py spec.json out.json

A separate process per engine: vLLM's plugin loading and our patches are
process-global. spec: {"model", "dtype" (default float32), "engine": {LLM kwargs},
"max_tokens",
"requests": [{"prompt_ids", "lora_name", "lora_path", "max_tokens"}]}. Every request is
submitted in one `generate` call so they share batches. With the plugin on,
the output also holds the workers' LoRA module table (loraserve_lora_modules)
and residency report (loraserve_residency). spec "warm_round": true runs the
same requests once before, under other adapter names (outputs dropped;
"warm_residency": the residency report after it), each round's adapters read
into host memory before it; spec "read_ahead": true reads the adapters into
host memory before the one round. spec "again": true runs the requests once more
after, with the same adapters ("again": their outputs, as "outputs").
"""

import json
import sys


def _read_ahead(llm, loras) -> None:
    """add_lora for each distinct adapter of `loras`: with the plugin's pool,
    a read into its host tier (not its device pool)."""
    for lr in {lr.lora_int_id: lr for lr in loras if lr is not None}.values():
        llm.llm_engine.add_lora(lr)


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enable_lora=True, seed=0,
              max_model_len=256, **spec["engine"])
    ids: dict[str, int] = {}
    loras = []
    for r in spec["requests"]:
        if r["lora_name"] is None:
            loras.append(None)
        else:
            lora_id = ids.setdefault(r["lora_name"], len(ids) + 1)
            loras.append(LoRARequest(r["lora_name"], lora_id, r["lora_path"]))
    params = [SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens") or spec["max_tokens"],
                             logprobs=1, ignore_eos=True) for r in spec["requests"]]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in spec["requests"]]
    if spec.get("warm_round"):
        # The same requests first, under other adapter names and ids (so the
        # adapters are cold again in the measured round), outputs dropped:
        # every kernel the measured round launches has launched once in this
        # process. CUDA loads a kernel at its first launch, and that load
        # waits for the whole device, side streams included.
        # Each round's adapters are read into host memory first (add_lora),
        # so that its steps do not depend on when each read ends: the two
        # rounds then run the same steps, and so the same token counts. On an
        # H200 they did not without this (docs/benchmarks/cold-start.md,
        # session 16: one step of 1652 tokens, then 1433 + 244).
        warm = [None if lr is None else
                LoRARequest(lr.lora_name + "@warm", lr.lora_int_id + len(ids), lr.lora_path)
                for lr in loras]
        _read_ahead(llm, warm)
        llm.generate(prompts, params, lora_request=warm, use_tqdm=False)
        _read_ahead(llm, loras)
    elif spec.get("read_ahead"):
        # Every adapter in host memory before the first step: the steps then
        # do not depend on when each background read ends.
        _read_ahead(llm, loras)
    plugin = "loraserve" in (spec["engine"].get("additional_config") or {})
    # The pool's counters add up over both rounds: the warm round's alone.
    warm_residency = (llm.collective_rpc("loraserve_residency")[0]
                      if plugin and spec.get("warm_round") else None)
    def generate():
        return [{"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason,
                 "logprobs": [lp[t].logprob
                              for lp, t in zip(c.logprobs or [], c.token_ids, strict=True)]}
                for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                for c in o.outputs[:1]]

    result = {"outputs": generate(), "lora_modules": None, "residency": None,
              "warm_residency": warm_residency}
    if spec.get("again"):
        result["again"] = generate()
    if plugin:
        result["lora_modules"] = llm.collective_rpc("loraserve_lora_modules")[0]
        result["residency"] = llm.collective_rpc("loraserve_residency")[0]
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
