"""tests/e2e/vllm_generate.py with every step's layer-group page loads held
back on the side stream (`delay_cycles` of torch.cuda._sleep queued before
them), so a pipelined layer really spins on its group's flag and a
cpu-assist layer really finds its group not landed.

    python slow_side.py spec.json out.json

spec: as vllm_generate.py, plus "delay_cycles". Where $LORASERVE_RESULTS_DIR
is set, a probe of each load step goes to slow_side-<pid>.jsonl there: the
host seconds of `ColdStart.load` and of its slowest group write,
whether group 0 had landed when layer 0 asked (a host wait inside the load
lets the held-back groups land before the forward pass reaches them), and
the engine thread's stack SAMPLE_S after the load if layer 0 had not asked
by then (where the host waits).
"""

import functools
import json
import os
import sys
import threading
import time
import traceback

# When the engine's thread's stack is sampled after a load, if layer 0 has not asked yet.
SAMPLE_S = 0.2
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))


def _probe(cold_start, out_dir: str) -> None:
    path = os.path.join(out_dir, f"slow_side-{os.getpid()}.jsonl")
    step: dict = {}
    load, write, before = (cold_start.ColdStart.load, cold_start.ColdStart._write,
                           cold_start.ColdStart.before_layer)

    def timed_load(self, loads):
        step.clear()
        step.update(mode=self.mode, adapters=len(loads), write_max_s=0.0,
                    module_loading=os.environ.get("CUDA_MODULE_LOADING", ""))
        t0 = time.perf_counter()
        load(self, loads)
        step["load_s"] = time.perf_counter() - t0
        step["loaded_at"] = time.perf_counter()
        threading.Timer(SAMPLE_S, sample, (threading.get_ident(), step["loaded_at"])).start()

    def sample(ident, loaded_at):
        # Where the engine's thread is, if it has not reached layer 0 yet.
        if step.get("loaded_at") == loaded_at:
            frame = sys._current_frames().get(ident)
            step["stack_after_load"] = traceback.format_stack(frame)[-30:] if frame else None

    def timed_write(self, cold, g):
        t0 = time.perf_counter()
        write(self, cold, g)
        step["write_max_s"] = max(step.get("write_max_s", 0.0), time.perf_counter() - t0)

    def probed_before(self, layer, x):
        if layer == 0 and "loaded_at" in step:
            step["layer0_after_s"] = time.perf_counter() - step.pop("loaded_at")
            step["group0_landed"] = self.lane.landed(0)
            with open(path, "a") as f:
                f.write(json.dumps(step) + "\n")
        before(self, layer, x)

    cold_start.ColdStart.load = timed_load
    cold_start.ColdStart._write = timed_write
    cold_start.ColdStart.before_layer = probed_before

    # Host seconds since the load, at the entry and exit of each step of
    # vLLM's runner between it and layer 0: where the host waits, if it does.
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loraserve.worker.paged_manager import PagedWorkerLoRAManager

    seen: set[int] = set()

    def marked(cls, name):
        fn = getattr(cls, name)

        @functools.wraps(fn)  # the plugin's compat check reads the signature
        def wrapper(*a, **kw):
            if name == "_update_states":  # a step's token count: new to this process?
                n = a[1].total_num_scheduled_tokens
                step["tokens"], step["tokens_seen_before"] = n, n in seen
                seen.add(n)
            if "loaded_at" in step:
                step.setdefault("marks", []).append(
                    (name, round(time.perf_counter() - step["loaded_at"], 4)))
            out = fn(*a, **kw)
            if "loaded_at" in step:
                step.setdefault("marks", []).append((name + " done",
                                      round(time.perf_counter() - step["loaded_at"], 4)))
                if name == "_determine_batch_execution_and_padding":
                    step["cudagraph_mode"] = str(out[0])
            return out
        setattr(cls, name, wrapper)

    for name in ("_update_states", "_prepare_inputs", "_determine_batch_execution_and_padding",
                 "_get_slot_mappings", "_build_attention_metadata", "_preprocess"):
        marked(GPUModelRunner, name)
    for name in ("apply_step", "set_active_adapters"):
        marked(PagedWorkerLoRAManager, name)


def main() -> None:
    import torch

    from vllm_loraserve.worker import cold_start, load_lane

    cycles = json.load(open(sys.argv[1]))["delay_cycles"]
    start = load_lane.StreamLane.start

    def delayed(self):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)
        start(self)

    load_lane.StreamLane.start = delayed
    if os.environ.get("LORASERVE_RESULTS_DIR"):
        _probe(cold_start, os.environ["LORASERVE_RESULTS_DIR"])

    from vllm_generate import main as generate

    generate()


if __name__ == "__main__":
    main()
