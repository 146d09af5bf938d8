"""One in-process engine (engine core in this process, so torch.profiler
sees the engine thread and the host tier's readers): a warm-up round of
requests, then a round with cold adapters (never read) under torch.profiler,
then a control that pins one new block under the profiler.

    python pin_probe.py spec.json out.json

spec: {"model", "engine": {LLM kwargs}, "max_tokens", "rounds": [warm-up,
profiled], each a list of {"prompt_ids", "lora_name", "lora_path"}}.
Out: the CUDA runtime calls counted in each profile, the outputs' lengths,
and the pool's residency report before and after the profiled round.
"""

import json
import sys

CONTROL_BYTES = (48 << 20) + 12345  # a size class no engine buffer uses


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="bfloat16", enable_lora=True, seed=0,
              max_model_len=256, **spec["engine"])
    ids: dict[str, int] = {}

    def generate(requests: list[dict]) -> list[int]:
        loras = [LoRARequest(r["lora_name"], ids.setdefault(r["lora_name"], len(ids) + 1),
                             r["lora_path"]) for r in requests]
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests],
                            params, lora_request=loras, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def calls(prof) -> dict[str, int]:
        return {e.key: e.count for e in prof.key_averages() if e.key.startswith("cuda")}

    def pinning_sites(prof) -> list[dict]:
        """Each pinning call's enclosing ops and Python stack (where a failure points)."""
        sites = []
        for e in prof.events():
            if e.name not in ("cudaHostRegister", "cudaHostAlloc", "cudaMallocHost"):
                continue
            parents, stack, p = [], [], e.cpu_parent
            while p is not None:
                parents.append(p.name)
                stack = stack or list(p.stack or [])  # the innermost op's: the whole stack
                p = p.cpu_parent
            sites.append({"call": e.name, "thread": e.thread, "ops": parents,
                          "stack": stack[:16]})
        return sites

    warm, cold = spec["rounds"]
    lengths = generate(warm)
    before = llm.collective_rpc("loraserve_residency")[0]  # drains its events
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=True) as prof:
        lengths += generate(cold)
    after = llm.collective_rpc("loraserve_residency")[0]
    with profile(activities=activities) as control:
        block = torch.empty(CONTROL_BYTES, dtype=torch.uint8, pin_memory=True)
    assert block.is_pinned()
    json.dump({"serving": calls(prof), "serving_pinning_sites": pinning_sites(prof),
               "control": calls(control), "lengths": lengths,
               "ids": ids, "before": before, "after": after}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
