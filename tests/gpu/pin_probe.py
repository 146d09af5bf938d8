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
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

CONTROL_BYTES = (48 << 20) + 12345  # a size class no engine buffer uses


class PinSites(TorchFunctionMode):
    """The Python stacks of the torch calls on this thread that may pin host
    memory: an allocation with pin_memory=True, Tensor.pin_memory, and a
    non-blocking copy of a CUDA tensor to the CPU (torch pins its target)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[tuple[str, ...]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory") or func is torch.Tensor.pin_memory or (
                func is torch.Tensor.to and _to_cpu_non_blocking(args, kwargs)):
            frames = traceback.extract_stack()[:-1]
            self.sites[tuple(f"{f.filename}:{f.lineno}" for f in frames[-10:])] += 1
        return func(*args, **kwargs)


def _to_cpu_non_blocking(args, kwargs) -> bool:
    if not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
        return False
    rest = list(args[1:]) + list(kwargs.values())
    cpu = any(str(a) == "cpu" for a in rest if isinstance(a, str | torch.device))
    return cpu and (kwargs.get("non_blocking") is True or any(a is True for a in args[1:]))


def main() -> None:
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

    def threads(prof) -> dict[str, dict[int, int]]:
        """Pinning and launch calls per profiled thread."""
        out: dict[str, Counter] = {"pin": Counter(), "launch": Counter()}
        for e in prof.events():
            if e.name in ("cudaHostRegister", "cudaHostAlloc", "cudaMallocHost"):
                out["pin"][e.thread] += 1
            elif e.name in ("cudaLaunchKernel", "cudaGraphLaunch"):
                out["launch"][e.thread] += 1
        return {k: dict(v) for k, v in out.items()}

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
    sites = PinSites()
    with profile(activities=activities, with_stack=True) as prof, sites:
        lengths += generate(cold)
    after = llm.collective_rpc("loraserve_residency")[0]
    with profile(activities=activities) as control:
        block = torch.empty(CONTROL_BYTES, dtype=torch.uint8, pin_memory=True)
    assert block.is_pinned()
    json.dump({"serving": calls(prof), "serving_pinning_sites": pinning_sites(prof),
               "serving_threads": threads(prof),
               "torch_pin_sites": [{"count": n, "stack": list(st)}
                                   for st, n in sites.sites.most_common()],
               "control": calls(control), "lengths": lengths,
               "ids": ids, "before": before, "after": after}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
