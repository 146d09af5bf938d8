"""One in-process engine whose disk read of one adapter stalls until every
other request has finished (or 60 s pass): shows whether a step waits on a
read. Greedy tokens, logprobs and the order requests finished go to JSON.

    python slow_read.py spec.json out.json

spec: as vllm_generate.py, plus "slow": the adapter name whose read stalls.
"""

import json
import sys
import threading


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

    spec = json.load(open(sys.argv[1]))
    others_done = threading.Event()
    read_file = PagedWorkerLoRAManager._read_file

    def stalled_read(self, lora_request, alloc):
        if lora_request.lora_name == spec["slow"]:
            others_done.wait(timeout=60)
        return read_file(self, lora_request, alloc)

    PagedWorkerLoRAManager._read_file = stalled_read
    llm = LLM(model=spec["model"], dtype="float32", enable_lora=True, seed=0, max_model_len=256,
              **spec["engine"])
    engine = llm.llm_engine
    ids: dict[str, int] = {}
    slow_ids = set()
    for i, r in enumerate(spec["requests"]):
        lora = None
        if r["lora_name"] is not None:
            lora = LoRARequest(r["lora_name"], ids.setdefault(r["lora_name"], len(ids) + 1),
                               r["lora_path"])
            if r["lora_name"] == spec["slow"]:
                slow_ids.add(str(i))
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["prompt_ids"]),
                           SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"],
                                          logprobs=1, ignore_eos=True), lora_request=lora)
    finished, outputs = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
                c = o.outputs[0]
                outputs[o.request_id] = {
                    "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                    "logprobs": [lp[t].logprob
                                 for lp, t in zip(c.logprobs or [], c.token_ids, strict=True)]}
        if len(set(finished) - slow_ids) == len(spec["requests"]) - len(slow_ids):
            others_done.set()
    json.dump({"finished": finished, "slow_ids": sorted(slow_ids),
               "outputs": [outputs[str(i)] for i in range(len(spec["requests"]))],
               "residency": llm.collective_rpc("loraserve_residency")[0]},
              open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
