"""How much the host tier's reads slow the engine thread's steps, and what
the read gate (--loraserve-read-pause forward) gives back. No GPU, no vLLM.

In the e2e protocol's pool-1000 run on an H200 host (docs/benchmarks/e2e.md,
session 36), a ~660-token decode step took the engine thread 6-7 ms of host
time with the tier's readers idle, and 18-105 ms while they read. This
models that on the CPU: the main thread runs steps of `--ops` small torch
calls (each releases and retakes the GIL, as a forward pass's launches do),
then sleeps `--gpu-ms` (the wait for the GPU: the GIL is free). Meanwhile
`--readers` threads read adapters of the e2e shape (Llama-2-7B q/k/v/o,
rank 64, bf16) from `--root` in a loop, as the tier does: `read_weights`
with the value screen, split over as many part threads (`threads`), or
through as many reader processes (`processes`). With `pause`, each step's
calls run with worker/read_gate.py's gate closed and the reads pass its
checkpoints (each read counted by the gate's `reading`, as the tier's are: a
single reader is a lone read, which the gate never parks). Per case: the
step's wall time (p50, p90), the engine thread's wait in it (wall minus its
CPU time: the GIL, or a core), and the reads' rate.

    PYTHONPATH=src python benchmarks/e2e/read_contention.py --out read_contention.json

A machine with fewer cores than the readers' threads plus one measures
CPU contention too, not the GIL alone: the JSON records the core count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_loraserve.adapters.peft import read_weights, write_adapter
from vllm_loraserve.worker.cpu_lora.shm import SharedSegment
from vllm_loraserve.worker.file_readers import ReaderProcesses
from vllm_loraserve.worker.read_gate import ReadGate

RANK, HIDDEN, LAYERS = 64, 4096, 32
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
BUFFER = (RANK * HIDDEN * 2 * 2 * len(MODULES) * LAYERS) + (1 << 20)


def make_adapters(root: str, n: int) -> list[str]:
    paths = []
    for i in range(n):
        path = os.path.join(root, f"a{i}")
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            g = torch.Generator().manual_seed(i)
            write_adapter(path, {f"model.layers.{layer}.self_attn.{m}": (
                (torch.randn(RANK, HIDDEN, generator=g) * 0.01).bfloat16(),
                (torch.randn(HIDDEN, RANK, generator=g) * 0.01).bfloat16())
                for layer in range(LAYERS) for m in MODULES}, rank=RANK, alpha=16,
                base_model="x")
        paths.append(path)
    return paths


def steps(seconds: float, ops: int, gpu_ms: float, gate: ReadGate | None) -> list[tuple]:
    """(wall, CPU) seconds of each step's calls."""
    x, out = torch.zeros(4096), []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, c0 = time.perf_counter(), time.thread_time()
        with gate.closed() if gate else contextlib.nullcontext():
            for _ in range(ops):
                x = x + 1.0
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
        time.sleep(gpu_ms / 1e3)
    return out


def case(paths: list[str], read_in: str, readers: int, pause: bool, a: argparse.Namespace
         ) -> dict:
    gate = ReadGate() if pause else None
    stop, reads = threading.Event(), [0]
    segments = [SharedSegment.create(BUFFER, f"rc{i}") for i in range(readers)] \
        if read_in == "processes" else []
    files = ReaderProcesses(segments, readers) if segments else None
    buffers = [s.bytes for s in segments] if segments else \
        [torch.empty(BUFFER, dtype=torch.uint8) for _ in range(readers)]
    parts = ThreadPoolExecutor(readers, thread_name_prefix="part") \
        if read_in == "threads" and readers else None

    def reader(i: int) -> None:
        k = i
        while not stop.is_set():
            with gate.reading() if gate else contextlib.nullcontext():
                read_weights(paths[k % len(paths)], lambda n, i=i: buffers[i][:n], 3e38,
                             parts=parts, files=files, pause=gate.pause if gate else None)
            reads[0] += 1
            k += 1

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the readers under way
    t0 = time.perf_counter()
    measured = steps(a.seconds, a.ops, a.gpu_ms, gate)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    if parts:
        parts.shutdown()
    if files:
        files.close()
    for s in segments:
        s.close()
    wall = sorted(w for w, _ in measured)
    return {"read_in": read_in if readers else "-", "readers": readers, "pause": pause,
            "steps": len(measured), "step_ms_p50": round(statistics.median(wall) * 1e3, 3),
            "step_ms_p90": round(wall[int(0.9 * len(wall))] * 1e3, 3),
            "wait_ms_mean": round(statistics.mean(w - c for w, c in measured) * 1e3, 3),
            "reads_per_s": round(reads[0] / (elapsed + 0.3), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/dev/shm/read-contention")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--readers", default="0,4", help="reader threads (or processes) per case")
    ap.add_argument("--read-in", default="threads,processes")
    ap.add_argument("--ops", type=int, default=300, help="torch calls a step")
    ap.add_argument("--gpu-ms", type=float, default=10.0, help="the wait after each step")
    ap.add_argument("--seconds", type=float, default=3.0, help="steps per case, in seconds")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    paths = make_adapters(a.root, a.adapters)
    results = []
    for readers in (int(r) for r in a.readers.split(",")):
        for read_in in a.read_in.split(",") if readers else ["threads"]:
            for pause in (False, True) if readers else (False,):
                results.append(case(paths, read_in, readers, pause, a))
                print(json.dumps(results[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"cores": os.cpu_count(), "ops": a.ops, "gpu_ms": a.gpu_ms,
                   "adapter_bytes": os.path.getsize(os.path.join(paths[0],
                                                                 "adapter_model.safetensors")),
                   "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
