"""No host memory is pinned while serving (issue 23; marker `gpu`).

Pinning while serving stalls the engine: on an H200 the host tier's reads
ran `cudaHostRegister` 253 times at 15.5 ms a call in 400 requests, and the
engine thread's launches took 163 us instead of ~13 us meanwhile
(docs/benchmarks/e2e.md). The host tier now reads into an arena pinned at
start-up (worker/arena.py) and the slot table copies from pinned rows made
with it (kernels/batch.py `RowStaging`).

An engine on the `small` model serves a warm-up round with eight adapters,
then the same eight adapters under new names and paths (cold: never read),
with a host tier too small for both rounds (entries are evicted and their
memory reused), under torch.profiler. The profiled round must make no
`cudaHostRegister`, `cudaHostAlloc` or `cudaMallocHost` call by the plugin
(none on the host tier's reader threads; no torch call from its code that
may pin), while it does read and load every cold adapter. vLLM itself pins
the targets of its non-blocking device-to-host copies when its caching host
allocator meets a new size: the engine thread's pinning calls must not
outnumber the pinning-capable torch calls of vLLM's that the probe saw. A
control profile that pins one new block shows the profiler sees such calls.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from .case import MAX_TOKENS, build_case

pytestmark = pytest.mark.gpu
PIN_CALLS = ("cudaHostRegister", "cudaHostAlloc", "cudaMallocHost")
HERE = os.path.dirname(__file__)


def test_serving_cold_adapters_pins_no_host_memory(fixed_dir, tmp_path):
    root = fixed_dir("pin-gpu")
    model, reqs = build_case(root)
    warm = [r for r in reqs if r.lora_name]
    cold = []
    for r in warm:
        path = str(root / f"cold-{r.lora_name}")
        if not os.path.exists(path):
            shutil.copytree(r.lora_path, path)
        cold.append({**r.__dict__, "lora_name": f"cold-{r.lora_name}", "lora_path": path})
    spec = {"model": model, "max_tokens": MAX_TOKENS, "rounds": [[r.__dict__ for r in warm], cold],
            "engine": {"max_lora_rank": 128, "max_loras": 1, "max_num_seqs": 64,
                       "gpu_memory_utilization": 0.5,
                       # One 32 MiB chunk (the largest adapter, rank 128 everywhere
                       # in fp32, takes 19.9 MB): less than one round's adapters.
                       "additional_config": {"loraserve": {"host_cache_bytes": 32 << 20}}}}
    json.dump(spec, open(tmp_path / "spec.json", "w"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pin_probe.py"),
                           str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.load(open(tmp_path / "out.json"))
    out_dir = os.environ.get("LORASERVE_RESULTS_DIR")
    if out_dir:
        json.dump(out, open(os.path.join(out_dir, "gpu_no_pinning.json"), "w"), indent=1)

    assert out["lengths"] == [MAX_TOKENS] * (len(warm) + len(cold))
    # The profiler saw the engine's runtime calls, and sees a pinning call.
    assert out["serving"].get("cudaLaunchKernel", 0) + out["serving"].get(
        "cudaGraphLaunch", 0) > 0, out["serving"]
    assert sum(out["control"].get(c, 0) for c in PIN_CALLS) >= 1, out["control"]
    # Every cold adapter was read from disk and loaded in the profiled round.
    cold_ids = {out["ids"][r["lora_name"]] for r in cold}
    read = {lora_id for lora_id, tier, _ in out["after"]["events"] if tier == "host"}
    assert cold_ids <= read, (cold_ids, read)
    before, after = out["before"]["pool"], out["after"]["pool"]
    assert after["page_loads"] - before["page_loads"] >= len(cold_ids)
    assert after["host_budget"] == 32 << 20 and after["host_bytes"] <= 32 << 20
    # No pinning by the plugin: none on the host tier's reader threads (only
    # the engine thread launches), none from its code on the engine thread.
    # vLLM itself pins targets of its device-to-host copies (its caching host
    # allocator misses on new sizes): each such call must have a vLLM site.
    launch, pin = out["serving_threads"]["launch"], out["serving_threads"]["pin"]
    engine = max(launch, key=launch.get)
    assert not {t: n for t, n in pin.items() if t != engine}, out["serving_threads"]
    # The plugin's own call: its code is the torch call's caller (it also wraps
    # vLLM's execute_model, so its frames sit under every vLLM call).
    ours = [s for s in out["torch_pin_sites"] if "vllm_loraserve" in s["stack"][-1]]
    assert not ours, f"the plugin pinned host memory while serving: {ours}"
    assert pin.get(engine, 0) <= sum(s["count"] for s in out["torch_pin_sites"]), out
