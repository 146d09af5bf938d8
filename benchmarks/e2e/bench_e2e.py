#!/usr/bin/env python3
"""End-to-end offline throughput: the paged pool vs stock vLLM multi-LoRA.

The workload and method follow ../shared/design/baseline-stock-vllm-h200.md,
so its numbers can be compared (and its stock configs are rerun here, in the
same device session):
- `--shape llama2-7b` (hidden 4096, 32 layers, 32/32 heads, intermediate 11008,
  vocab 32000; the default) or `llama3-8b` (GQA 32/8, intermediate 14336,
  vocab 128256), dummy weights, bf16, gpu_memory_utilization 0.9,
  max_model_len 2048, vLLM's defaults otherwise (torch.compile, CUDA graphs),
  except the largest CUDA graph: `--graph-size decode` (the default) gives
  every config graphs that hold a decode step of max_num_seqs sequences (1024
  on H100/H200), as the plugin does for its pool (frontend/graph_sizes.py), so
  that the ratio to `none` is the cost of the LoRA work, not of graphs;
  `--graph-size N` gives every config graphs up to N tokens (512: vLLM's);
- 1000 requests, prompt and output lengths U[8,512] (random token ids,
  ignore_eos, temperature 1.0), all passed to one `generate`;
- adapter of a request ~ power law P(i) ~ (i+1)^-1 over the config's adapters;
- PEFT adapters on q,k,v,o (`--targets qkvo`, the default) or on every linear
  layer (`all-linear`), rank `--ranks`[i % len] (default 8,16,32,64,128),
  lora_alpha 2r. `--distinct` (default 100) weight sets are written once (to
  /dev/shm); adapter i is the directory names/a{i:04d}, whose files are hard
  links to weight set i % distinct, so 1000 or 2000 adapters fit the machine.
  Each name is a separate adapter to the server (its own id, pages and
  host-tier entry); the pool never shares weights by content.
- an untimed warm-up touches the first min(n, 100) adapters once (4 output
  tokens each); the timed run then includes every other adapter's first load
  from disk, and any reload after an eviction. `--warm-adapters N` warms
  min(n, N) instead and `--pool-config JSON` sets the plugin's options (e.g.
  a host tier that holds them all): with both, the timed run measures the
  kernels without first loads (a diagnostic, not the protocol).

Each config runs in its own child process (one engine). Results: one JSON per
config under --out, and results.json with them all. With `none` in the same
call, each config also gets its LoRA time per step (its step time minus
none's), the adapter bytes its kernels read per step (each distinct adapter
of a step once: the memory roofline), and its roofline efficiency: those
bytes' time at the device-to-device copy bandwidth measured in this call,
divided by the LoRA time (1.0: the LoRA work costs no more than reading its
weights once). That LoRA time (the issue's definition) credits each of the
config's steps with none's step time. Where resident adapters take KV pages
(1000-2000 adapters), a config runs more steps (`steps_vs_none`, none's over
its own) with less KV each, and in a KV-bound run such a step's base work is
cheaper: base-only runs ~1% more steps than none in the same total time. So
each config also gets `extra_ms_per_step` (its generation time minus none's,
over its steps: everything it costs beyond none), the roofline efficiency of
that (`roofline_efficiency_total`), and `roofline_ratio`: the ratio to none
if its base work took none's time and its LoRA work exactly its bytes' time.
`none-kvN` is `none` on V1 (the pool's runner) with N KV blocks: with N = a
pool config's blocks minus its adapter pages it runs about its steps without
LoRA, and the config then also gets its LoRA time against it (`*_kv_matched`):
the LoRA work alone, what its extra steps cost aside.

    python3 benchmarks/e2e/bench_e2e.py --configs none,stock-100,pool-100 --out $OUT
    python3 benchmarks/e2e/bench_e2e.py --shape llama3-8b --targets all-linear \
        --ranks 16,32,64 --configs none,stock-200,pool-200 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import IO, Any

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                      rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      rope_theta=500000.0),
}
HEAD_DIM = 128
DEFAULT_RANKS = (8, 16, 32, 64, 128)
# PEFT modules -> vLLM's wrapped layers (vLLM wraps only what adapters target).
TARGETS = {"qkvo": (("q_proj", "k_proj", "v_proj", "o_proj"), ["qkv_proj", "o_proj"]),
           "all-linear": (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])}

# name -> (number of adapters, plugin on, engine kwargs); 0 adapters: base requests only
STOCK_KW = dict(enable_lora=True, max_loras=32)  # tuned (baseline doc)
CONFIGS: dict[str, tuple[int, bool, dict]] = {
    "none": (0, False, {}),
    "stock-100": (100, False, dict(STOCK_KW, max_cpu_loras=100)),
    "stock-200": (200, False, dict(STOCK_KW, max_cpu_loras=200)),
    "pool-100": (100, True, {}),
    "pool-200": (200, True, {}),
    "pool-1000": (1000, True, {}),
    "pool-2000": (2000, True, {}),
    "pool-r8-single": (1, True, {}),
    "pool-base-only": (0, True, {}),
    "none-v1": (0, False, {}),
}
KV_MATCHED = re.compile(r"none-kv(\d+)")


def config_of(name: str) -> tuple[int, bool, dict]:
    """CONFIGS[name], or `none-kvN`: `none` on V1 with N KV blocks. Run with
    N = a pool config's KV blocks minus its adapter pages, it runs about
    that config's steps, each with as few requests as its KV allows, without
    LoRA: the base cost of the pool's concurrency (kv_matched())."""
    m = KV_MATCHED.fullmatch(name)
    if m:
        return 0, False, {"num_gpu_blocks_override": int(m.group(1))}
    return CONFIGS[name]


# The plugin's pool runs on vLLM's V1 model runner (V2 does not support it),
# while `none` and stock get vLLM's default, V2. `none-v1` is `none` on V1: the
# runner's share of every pool config's gap, apart from the pool's own.
CONFIG_ENV = {"none-v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}


def config_env(name: str) -> dict[str, str]:
    """A config's environment; `none-kvN` runs on V1, as the pool's configs
    do, so that a LoRA time against it holds no runner's difference."""
    if KV_MATCHED.fullmatch(name):
        return CONFIG_ENV["none-v1"]
    return CONFIG_ENV.get(name, {})


POOL_KW = dict(enable_lora=True, max_loras=1, additional_config={"loraserve": {}})
GRAPH_KEYS = ("max_cudagraph_capture_size", "cudagraph_capture_sizes")
# bench_e2e.py's defaults: a run with others is a diagnostic (summary.py says so).
PROTOCOL = {"warm_adapters": 100, "pool_config": {}, "engine_kw": {}, "graph_size": "decode"}


def graph_kw(plugin: bool, graph_size: str, kw: dict) -> dict:
    """The engine arguments that give a config with engine arguments `kw`
    the run's largest CUDA graph."""
    if graph_size != "decode":
        return {"max_cudagraph_capture_size": int(graph_size)}
    if plugin:
        return {}  # the plugin's own choice, which this bench measures
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_loraserve.frontend.graph_sizes import decode_capture_size

    # What the plugin sees: vLLM's defaults for LLM(...) unless kw sets them.
    tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    ctx = UsageContext.LLM_CLASS
    size = decode_capture_size(kw.get("max_num_seqs") or seqs[ctx], 1,
                               kw.get("max_num_batched_tokens") or tokens[ctx])
    return {"max_cudagraph_capture_size": size}


def module_dims(shape: dict) -> dict[str, tuple[str, int, int]]:
    """PEFT module -> (its block, in, out) in one decoder layer."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * HEAD_DIM, shape["num_key_value_heads"] * HEAD_DIM
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv),
            "v_proj": ("self_attn", h, kv), "o_proj": ("self_attn", q, h),
            "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i), "down_proj": ("mlp", i, h)}


def log(*a: object) -> None:
    print("[e2e]", *a, flush=True)


# -- assets ------------------------------------------------------------------------
def write_model(d: str, shape: dict) -> None:
    os.makedirs(d, exist_ok=True)
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "head_dim": HEAD_DIM,
               **shape}, open(os.path.join(d, "config.json"), "w"))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok.save(os.path.join(d, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "model_max_length": 4096}, open(os.path.join(d, "tokenizer_config.json"), "w"))


def write_adapters(root: str, n_names: int, shape: dict, targets: tuple[str, ...],
                   ranks: tuple[int, ...], distinct: int) -> None:
    """`distinct` weight sets (generated on the GPU), hard-linked under n_names
    names. `root` is per (shape, targets, ranks): see main."""
    import torch

    from vllm_loraserve.adapters.peft import write_adapter

    dims = module_dims(shape)
    for i in range(distinct):
        d = os.path.join(root, "w", f"w{i:03d}")
        if os.path.exists(os.path.join(d, "adapter_config.json")):
            continue
        r = ranks[i % len(ranks)]
        g = torch.Generator(device="cuda").manual_seed(i + 1)
        weights = {}
        for layer in range(shape["num_hidden_layers"]):
            for m in targets:
                block, n_in, n_out = dims[m]
                a = torch.randn(r, n_in, device="cuda", generator=g) / n_in ** 0.5
                b = torch.randn(n_out, r, device="cuda", generator=g) * 0.05
                weights[f"model.layers.{layer}.{block}.{m}"] = (
                    a.to(torch.bfloat16).cpu(), b.to(torch.bfloat16).cpu())
        write_adapter(d, weights, rank=r, alpha=2 * r, base_model="bench-shape")
    for i in range(n_names):
        d = os.path.join(root, "names", f"a{i:04d}")
        if os.path.isdir(d):
            continue
        os.makedirs(d)
        src = os.path.join(root, "w", f"w{i % distinct:03d}")
        for f in os.listdir(src):
            os.link(os.path.join(src, f), os.path.join(d, f))


def asset_dirs(root: str, shape: str, targets: str, ranks: tuple[int, ...]) -> tuple[str, str]:
    """(model directory, adapters root): the model's path keys vLLM's compile
    cache, so there is one per shape; adapters per shape, targets and ranks."""
    model_root = os.path.join(root, shape)
    return (os.path.join(model_root, "model"),
            os.path.join(model_root, f"{targets}-r{'-'.join(map(str, ranks))}"))


# -- workload ----------------------------------------------------------------------
def workload(n_adapters: int, vocab: int = 32000, seed: int = 0, num: int = 1000, lo: int = 8,
             hi: int = 512):
    """The baseline's workload: identical prompts and lengths for every config
    (token ids below 32000 whatever the vocabulary: the same prompts on every shape)."""
    rng = random.Random(seed)
    in_lens = [rng.randint(lo, hi) for _ in range(num)]
    out_lens = [rng.randint(lo, hi) for _ in range(num)]
    prompts = [[rng.randrange(4, min(vocab, 32000)) for _ in range(k)] for k in in_lens]
    adapters = None
    if n_adapters:
        w = [(i + 1) ** -1.0 for i in range(n_adapters)]
        adapters = random.Random(seed + 1).choices(range(n_adapters), weights=w, k=num)
    return prompts, out_lens, adapters


class Pacing:
    """Who paces the timed run, from `start` (its `time.monotonic()`): the
    GPU's utilisation (NVML: the share of each sample period in which some
    kernel ran, sampled every 20 ms), its mean and its idle share in each
    second of the run (`gpu_idle_by_second`: where in the run the GPU
    waited, to set beside the step trace's `mono` times less `start`; a
    reading covers NVML's last sample period, 1/6 s to 1 s by GPU, up to its
    time, so the bins lag and blur by up to that period), and the CPU
    seconds of this process and of each engine process it started, over the
    run's wall time. An engine process near 1.0 CPU while the GPU is well
    below 1.0 is bound by its host."""

    def __init__(self, start: float) -> None:
        self.start = start

    def __enter__(self) -> Pacing:
        import threading

        import psutil

        self._samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            gpu = nvml_handle(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        except Exception as e:  # no NVML here: the CPU side is still measured
            log(f"no GPU utilisation: {e!r}")
            gpu = None

        def sample() -> None:
            while gpu is not None and not self._stop.wait(0.02):
                self._samples.append((time.monotonic(),
                                      pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu))

        me = psutil.Process()
        self._procs = [me, *me.children(recursive=True)]
        self._cpu0 = [sum(p.cpu_times()[:2]) for p in self._procs]
        self._thread = threading.Thread(target=sample, daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        cpu = {}
        for p, c0 in zip(self._procs, self._cpu0, strict=True):
            try:
                cpu[f"{p.name()}-{p.pid}"] = round((sum(p.cpu_times()[:2]) - c0) / wall, 3)
            except Exception:  # an engine helper that exited
                continue
        util = [u for _, u in self._samples]
        self.result = {"gpu_util_mean": round(sum(util) / len(util) / 100, 3) if util else None,
                       "gpu_util_samples": len(util),
                       "gpu_idle_by_second": idle_by_second(self._samples, self.start),
                       "cpu_per_wall": cpu}


def idle_by_second(samples: list[tuple[float, int]], start: float) -> list[float | None]:
    """The GPU's idle share (1 - mean utilisation) in each second from
    `start` (monotonic) up to the last sample (the last bin a part of a
    second), of (time, utilisation %) samples; samples before `start` are
    left out, and a second without samples is None."""
    samples = [(t, u) for t, u in samples if t >= start]
    if not samples:
        return []
    bins: list[list[int]] = [[] for _ in range(int(max(t for t, _ in samples) - start) + 1)]
    for t, u in samples:
        bins[int(t - start)].append(u)
    return [round(1 - sum(b) / len(b) / 100, 3) if b else None for b in bins]


def nvml_handle(pynvml: Any, visible: str) -> Any:
    """NVML's handle of the GPU the engine uses, its first visible device:
    NVML numbers every GPU of the machine and ignores CUDA_VISIBLE_DEVICES,
    which names a device by index or by UUID."""
    first = visible.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    return pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)


# -- one config (child) -------------------------------------------------------------
def run_config(name: str, model: str, adapters_root: str, out: str, profile: int,
               targets: str, max_rank: int, warm_adapters: int = 100,
               pool_config: dict | None = None, profile_cpu: bool = True,
               engine_kw: dict | None = None, graph_size: str = "decode") -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    n, plugin, extra = config_of(name)
    kw = dict(model=model, load_format="dummy", dtype="bfloat16",
              max_model_len=2048, gpu_memory_utilization=0.9, seed=0, disable_log_stats=False)
    kw.update(POOL_KW if plugin else {}, **extra)
    kw.update(engine_kw or {})
    kw.update(graph_kw(plugin, graph_size, kw))
    if plugin and pool_config:
        kw["additional_config"] = {"loraserve": dict(pool_config)}
    if kw.get("enable_lora"):
        kw.update(max_lora_rank=max_rank, lora_target_modules=TARGETS[targets][1])
    prompts, out_lens, adapters = workload(n if name != "pool-base-only" else 0,
                                           json.load(open(kw["model"] + "/config.json"))[
                                               "vocab_size"])
    if name == "pool-r8-single":
        adapters = [0] * len(prompts)
    res: dict = {"config": name, "adapters": n, "plugin": plugin,
                 "engine_kwargs": {k: v for k, v in kw.items() if k != "model"}}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    vc = llm.llm_engine.vllm_config
    res["num_gpu_blocks"] = vc.cache_config.num_gpu_blocks
    res["graph_max_size"] = vc.compilation_config.max_cudagraph_capture_size
    lreqs = [LoRARequest(f"a{i:04d}", i + 1, os.path.join(adapters_root, "names", f"a{i:04d}"))
             for i in range(n)] if kw.get("enable_lora") and n else []
    if adapters is not None:
        res["distinct_adapters_used"] = len(set(adapters))
    wrng = random.Random(7)
    warm_n = max(1, min(n, warm_adapters))
    nw = max(32, warm_n)
    warm = [TokensPrompt(prompt_token_ids=[wrng.randrange(4, 32000)
                                           for _ in range(wrng.randint(8, 512))])
            for _ in range(nw)]
    t = time.perf_counter()
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True),
                 lora_request=[lreqs[i % warm_n] for i in range(nw)]
                 if lreqs and adapters is not None else None, use_tqdm=False)
    res["warmup_s"] = round(time.perf_counter() - t, 2)
    res["warm_adapters"] = warm_n if lreqs and adapters is not None else 0

    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=o, ignore_eos=True)
              for o in out_lens]
    lora = [lreqs[i] for i in adapters] if adapters is not None and lreqs else None
    if profile:
        return _profile(llm, name, prompts[:profile], params[:profile],
                        lora[:profile] if lora else None, out, profile_cpu)
    m0 = _metrics(llm)
    if plugin:  # drain the warm-up's load events
        before = llm.collective_rpc("loraserve_residency")[0]["pool"]
    t, mono0 = time.perf_counter(), time.monotonic()
    with Pacing(mono0) as pacing:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            lora_request=lora, use_tqdm=False)
    dt, mono1 = time.perf_counter() - t, time.monotonic()
    res["pacing"] = pacing.result
    res["timed_mono"] = [round(mono0, 6), round(mono1, 6)]  # the step trace's clock
    if plugin and os.environ.get(STEP_TRACE_ENV):
        res["step_trace"] = step_trace_summary(os.environ[STEP_TRACE_ENV], mono0, mono1)
    m1 = _metrics(llm)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    res.update(gen_s=round(dt, 2), in_tok=n_in, out_tok=n_out, out_tok_expected=sum(out_lens),
               out_tok_s=round(n_out / dt, 1), total_tok_s=round((n_in + n_out) / dt, 1),
               engine_steps=m1.get("vllm:iteration_tokens_total:count", 0)
               - m0.get("vllm:iteration_tokens_total:count", 0),
               preemptions=m1.get("vllm:num_preemptions", 0) - m0.get("vllm:num_preemptions", 0))
    if plugin:
        snap = llm.collective_rpc("loraserve_residency")[0]
        res["pool"] = snap["pool"]
        # Where load time went in the timed run: disk -> host tier (read and
        # pack, on the reader threads unless a step had to read: a prefetch
        # miss), host -> pages (copy, inside the step).
        for tier in ("host", "gpu"):
            secs = [s for _, t_, s in snap["events"] if t_ == tier]
            res["pool"][f"{tier}_loads_timed"] = len(secs)
            res["pool"][f"{tier}_load_s_timed"] = round(sum(secs), 2)
        # Per admitted request: seconds until its adapter was ready (scheduler/waits.py).
        waits = sorted(snap["adapter_waits"])
        if waits:
            res["pool"]["adapter_wait_s"] = {
                "requests": len(waits), "waited": sum(w > 0 for w in waits),
                "p50": round(waits[len(waits) // 2], 3),
                "p99": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 3),
                "max": round(waits[-1], 3)}
        res["pool"]["adapters_resident_at_end"] = len(snap["gpu"])
        for key in ("load_pack_s", "load_write_s"):  # the loads' host time, split
            res["pool"][f"{key}_timed"] = round(snap["pool"][key] - before[key], 2)
        # The timed run's steps with adapter tokens: distinct adapters and the
        # sum of their ranks per step (what the LoRA kernels read per layer).
        steps = snap["pool"]["adapter_steps"] - before["adapter_steps"]
        for key in ("adapters", "ranks"):
            total = snap["pool"][f"adapter_step_{key}"] - before[f"adapter_step_{key}"]
            res["pool"][f"mean_step_{key}"] = round(total / steps, 1) if steps else 0
        # Over all the timed run's steps (main divides by its engine steps).
        res["adapter_bytes_timed"] = (snap["pool"]["adapter_step_bytes"]
                                      - before["adapter_step_bytes"])
        res["pool"]["kv_pages_free_at_end"] = (res["pool"]["total_pages"]
                                               - res["pool"]["adapter_pages"])
    log(f"{name}: {n_out} out tok in {dt:.2f} s -> {n_out / dt:.1f} out tok/s")
    json.dump(res, open(os.path.join(out, f"{name}.json"), "w"), indent=1)


# The pool's kernels (kernels/triton_mbgmm.py), by name.
LORA_KERNELS = ("_shrink_kernel", "_shrink_stream_kernel", "_expand_kernel")


# Upper bounds (µs) of the gap classes `gpu_busy` sums the idle time in:
# launch gaps inside a CUDA graph are a few µs; a host that paces the GPU
# leaves tens to hundreds; a step that waits for the host, milliseconds.
GAP_CLASSES_US = {"<=5us": 5, "<=50us": 50, "<=1ms": 1000, ">1ms": float("inf")}


STEP_TRACE_ENV = "LORASERVE_STEP_TRACE"  # worker/step_trace.py


def read_step_trace(prefix: str) -> list[dict]:
    """Every line of the step trace files of `prefix` (one per worker)."""
    import glob

    return [json.loads(line) for path in sorted(glob.glob(f"{prefix}-*.jsonl"))
            for line in open(path)]


def step_trace_summary(prefix: str, start: float, end: float) -> dict:
    """The timed run's steps in the workers' step traces (--step-trace):
    their periods and host times (the page decisions and loads apart, and
    the engine thread's CPU time in them), the engine thread's time between
    steps and the garbage collector's (means a step), and the full
    collections, cudaFrees and failed cudaMallocs (totals), apart for steps
    with page loads and without (what a load step costs beyond the others)."""
    # A step's period runs from the previous step's start: the first step of
    # the run (whose period holds the warm-up's end) is left out.
    steps = [r for r in read_step_trace(prefix)
             if r["period_s"] is not None and start <= r["mono"] - r["period_s"]
             and r["mono"] <= end]
    out: dict = {"steps": len(steps)}
    for name, group in (("load_steps", [r for r in steps if r["loads"]]),
                        ("other_steps", [r for r in steps if not r["loads"]])):
        n = len(group)
        out[name] = {"n": n, **({
            "period_ms": round(1e3 * sum(r["period_s"] for r in group) / n, 3),
            **{f"{k}_ms": round(1e3 * sum(r[f"{k}_s"] for r in group) / n, 3)
               for k in ("host", "apply", "cpu", "gap", "gc")},
            **{k: sum(r[k] or 0 for r in group)
               for k in ("gc_full", "device_frees", "alloc_retries")},
            "tokens": round(sum(r["tokens"] for r in group) / n, 1),
            "adapters": round(sum(r["adapters"] for r in group) / n, 1),
            "loads": round(sum(r["loads"] for r in group) / n, 2)} if n else {})}
    return out


def gpu_busy(events, wall_s: float) -> dict:
    """Seconds some kernel or copy ran on the GPU (the union of their
    intervals), against the run's wall time: the rest is the GPU waiting for
    the host. The gaps between those intervals, by length (`idle_gaps`:
    seconds and count per class of GAP_CLASSES_US; the idle time before the
    first and after the last interval is not a gap). Also the pool's
    kernels' own seconds and launches."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type.name == "CUDA")
    busy, end = 0.0, float("-inf")
    gaps = {k: [0.0, 0] for k in GAP_CLASSES_US}
    for a, b in spans:
        if a > end > float("-inf"):
            gap = next(k for k, c in GAP_CLASSES_US.items() if a - end <= c)
            gaps[gap][0] += (a - end) / 1e6
            gaps[gap][1] += 1
        if b > end:
            busy += b - max(a, end)
            end = b
    lora = [e.time_range.end - e.time_range.start for e in events
            if e.device_type.name == "CUDA" and e.name.startswith(LORA_KERNELS)]
    return {"wall_s": round(wall_s, 3), "busy_s": round(busy / 1e6, 3),
            "idle_s": round(wall_s - busy / 1e6, 3), "lora_kernel_s": round(sum(lora) / 1e6, 3),
            "lora_kernels": len(lora), "device_events": len(spans),
            "idle_gaps": {k: {"s": round(v[0], 4), "n": v[1]} for k, v in gaps.items()}}


def _profile(llm, name, prompts, params, lora, out, cpu: bool = True) -> None:
    """torch.profiler over a short run (engine core in this process: see main);
    `cpu`: trace host ops too (their cost slows the host), else only the GPU's
    kernels and copies."""
    from torch.profiler import ProfilerActivity, profile
    from vllm.inputs import TokensPrompt

    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                     lora_request=lora, use_tqdm=False)
        dt = time.perf_counter() - t
    table = prof.key_averages()
    busy = gpu_busy(prof.events(), dt)
    json.dump(busy, open(os.path.join(out, f"busy-{name}.json"), "w"), indent=1)
    log(f"{name}: GPU busy {busy['busy_s']:.2f} of {dt:.2f} s; LoRA kernels "
        f"{busy['lora_kernel_s']:.2f} s")
    with open(os.path.join(out, f"profile-{name}.txt"), "w") as f:
        f.write(f"{name}: {len(prompts)} requests in {dt:.2f} s (profiled)\n\n")
        f.write(json.dumps(busy) + "\n\n")
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    log(f"{name}: profile written")


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if hasattr(m, "count"):
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
        elif isinstance(getattr(m, "value", None), int | float):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


# -- parent ---------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes moved (read + written) per second:
    the rate a kernel that only reads its weights could at best read them."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def machine_id() -> str:
    """This boot of this machine: results files of several calls to one warm
    device machine carry the same id (summary.py pairs them with one `none`)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def same_graphs(config: dict, none: dict) -> bool:
    """Whether a config ran the same CUDA graphs as `none`: only then do its
    ratio and LoRA time compare (summary.py too)."""
    return config.get("graph_max_size") == none.get("graph_max_size")


# roofline()'s results that depend on none's run
VS_NONE = ("lora_ms_per_step", "steps_vs_none", "extra_ms_per_step", "roofline_ratio",
           "roofline_efficiency", "roofline_efficiency_total")
KV_MATCHED_KEYS = ("kv_matched", "kv_matched_steps", "lora_ms_per_step_kv_matched",
                   "roofline_efficiency_kv_matched", "lora_gpu_busy_ms_per_step_kv_matched",
                   "lora_gpu_idle_ms_per_step_kv_matched")
# A `none-kvN` run stands for a config's base work when their steps differ by
# at most this share: each step of difference is a whole step's time (~40 ms
# at Llama-2-7B) charged to LoRA, ~0.4 ms a step per 1%.
KV_MATCH_STEPS = 0.01


def bytes_time(r: dict, summary: dict) -> float | None:
    """Seconds a step of config `r` needs to read its adapter bytes once at the
    call's copy bandwidth (the memory roofline), where both are known."""
    if "adapter_bytes_timed" not in r or not summary.get("copy_bw_bytes_s"):
        return None
    return r["adapter_bytes_timed"] / r["engine_steps"] / summary["copy_bw_bytes_s"]


def roofline(summary: dict) -> None:
    """Each config's LoRA time per step (its step time minus none's), adapter
    bytes read per step and roofline efficiency (module docstring)."""
    kv_matched(summary)
    none = summary["configs"].get("none", {})
    if not none.get("engine_steps"):
        return
    none_step = none["gen_s"] / none["engine_steps"]
    for r in summary["configs"].values():
        for key in VS_NONE:  # computed again (summary.py), never kept from an older run
            r.pop(key, None)
        if not r.get("engine_steps"):
            continue
        if not same_graphs(r, none):
            r["vs_none"] = "graphs differ from none's: no LoRA time"
            continue
        step = r["gen_s"] / r["engine_steps"]
        r["step_ms"] = round(1e3 * step, 3)
        r["lora_ms_per_step"] = round(1e3 * (step - none_step), 3)
        r["steps_vs_none"] = round(none["engine_steps"] / r["engine_steps"], 3)
        extra = (r["gen_s"] - none["gen_s"]) / r["engine_steps"]
        r["extra_ms_per_step"] = round(1e3 * extra, 3)
        bytes_s = bytes_time(r, summary)
        if bytes_s is not None:
            r["adapter_bytes_per_step"] = round(r["adapter_bytes_timed"] / r["engine_steps"])
            r["roofline_ms_per_step"] = round(1e3 * bytes_s, 3)
            r["roofline_ratio"] = round(
                none["gen_s"] / (none["gen_s"] + r["engine_steps"] * bytes_s), 3)
            if extra > 0 and bytes_s > 0:
                r["roofline_efficiency_total"] = round(bytes_s / extra, 3)
            if step > none_step:
                r["roofline_efficiency"] = round(r["roofline_ms_per_step"]
                                                 / r["lora_ms_per_step"], 3)


def kv_matched(summary: dict) -> None:
    """A config's LoRA time against the `none-kvN` run of about its steps
    (within KV_MATCH_STEPS): its generation time minus that run's, over its
    steps. That run's steps hold as few requests as the config's KV allows,
    so the difference is the LoRA work alone, where the LoRA time against
    `none` charges each extra step at none's mean step. Where both runs have
    NVML's GPU utilisation, that time is split into the GPU's busy time
    beyond that run's (kernels, page copies) and the rest: the GPU idle,
    waiting for the host."""
    matched = {n: r for n, r in summary["configs"].items()
               if KV_MATCHED.fullmatch(n) and r.get("engine_steps")}
    for name, r in summary["configs"].items():
        for key in KV_MATCHED_KEYS:  # computed again, never kept from an older run
            r.pop(key, None)
        if name in matched or not r.get("plugin") or not r.get("engine_steps"):
            continue
        near = [(abs(m["engine_steps"] / r["engine_steps"] - 1), n) for n, m in matched.items()
                if same_graphs(r, m)]
        if not near:
            continue
        off, match = min(near)
        if off > KV_MATCH_STEPS:
            continue
        m = matched[match]
        lora_s = (r["gen_s"] - m["gen_s"]) / r["engine_steps"]
        r["kv_matched"], r["kv_matched_steps"] = match, m["engine_steps"]
        r["lora_ms_per_step_kv_matched"] = round(1e3 * lora_s, 3)
        bytes_s = bytes_time(r, summary)
        if bytes_s is not None and lora_s > 0:
            r["roofline_efficiency_kv_matched"] = round(bytes_s / lora_s, 3)
        utils = [x.get("pacing", {}).get("gpu_util_mean") for x in (r, m)]
        if None not in utils:
            busy_s = (r["gen_s"] * utils[0] - m["gen_s"] * utils[1]) / r["engine_steps"]
            r["lora_gpu_busy_ms_per_step_kv_matched"] = round(1e3 * busy_s, 3)
            r["lora_gpu_idle_ms_per_step_kv_matched"] = round(1e3 * (lora_s - busy_s), 3)


def run_child(cmd: list[str], env: dict, log_file: IO, timeout_s: float,
              grace_s: float = 5.0) -> int | str:
    """Run a config's child in a process group of its own: its exit code, or
    "timeout". With PYTHONFAULTHANDLER set, a child cut off at the time limit
    gets SIGABRT first, so each of its Python processes (the engine core, the
    host tier's reader processes) writes its threads' stacks to the log;
    then the whole group is killed, so that no engine of it still holds the
    GPU when the next config starts (an engine core outlived its killed
    parent in session 30)."""
    child = subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=log_file,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc: int | str = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = "timeout"
        os.killpg(child.pid, signal.SIGABRT)
        time.sleep(grace_s)
    try:
        os.killpg(child.pid, signal.SIGKILL)  # whatever of it is left
    except ProcessLookupError:
        pass
    child.wait()
    deadline = time.time() + 10  # until the group is gone (a zombie nobody reaps stays)
    while time.time() < deadline:
        try:
            os.killpg(child.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="none,stock-100,pool-100")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--targets", choices=sorted(TARGETS), default="qkvo")
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                    help="adapter i has rank RANKS[i %% len]; the engines' max_lora_rank is "
                         "the largest")
    ap.add_argument("--distinct", type=int, default=100, help="distinct weight sets")
    ap.add_argument("--commit", default=os.environ.get("LORASERVE_COMMIT", "unknown"),
                    help="recorded in results.json")
    ap.add_argument("--root", default="/dev/shm/loraserve-e2e")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/e2e-out"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=280, help="per config")
    ap.add_argument("--warm-adapters", type=int, default=100, metavar="N",
                    help="the untimed warm-up touches the first min(n, N) adapters (the "
                         "protocol: 100); more takes their first loads out of the timed run")
    ap.add_argument("--pool-config", default="{}", metavar="JSON",
                    help="the plugin's settings for the pool configs (additional_config "
                         "'loraserve'), e.g. '{\"host_cache_bytes\": 60000000000}'")
    ap.add_argument("--engine-kw", default="{}", metavar="JSON",
                    help="vLLM engine arguments for every config, e.g. "
                         "'{\"max_num_seqs\": 512}' "
                         "(off the protocol: recorded in the results)")
    ap.add_argument("--graph-size", default=PROTOCOL["graph_size"], metavar="decode|N",
                    help="the largest CUDA graph of every config: 'decode' holds a decode "
                         "step of max_num_seqs sequences (the protocol), N: N tokens (512 "
                         "is vLLM's default)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead of the timed run, profile the first N requests "
                         "(torch.profiler, engine core in-process) into profile-CONFIG.txt, "
                         "and the GPU's busy time into busy-CONFIG.json")
    ap.add_argument("--step-trace", action="store_true",
                    help="the pool configs' workers trace each step (worker/step_trace.py) "
                         "into CONFIG-steps-PID.jsonl; each config's results get the timed "
                         "run's steps with page loads and without, apart")
    ap.add_argument("--profile-gpu-only", action="store_true",
                    help="trace only the GPU's kernels and copies (tracing host ops slows "
                         "the host, which matters where the host paces the steps)")
    a = ap.parse_args()
    if a.graph_size != "decode" and not (a.graph_size.isdigit() and int(a.graph_size) >= 1):
        ap.error("--graph-size is 'decode' or a number of tokens (at least 1)")
    engine_kw = json.loads(a.engine_kw)
    if any(k in engine_kw or k in (engine_kw.get("compilation_config") or {})
           for k in GRAPH_KEYS):
        ap.error(f"set the graph sizes with --graph-size, not --engine-kw {GRAPH_KEYS}")
    ranks = tuple(int(r) for r in a.ranks.split(","))
    model, adapters = asset_dirs(a.root, a.shape, a.targets, ranks)
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        return run_config(a.child, model, adapters, a.out, a.profile, a.targets, max(ranks),
                          a.warm_adapters, json.loads(a.pool_config),
                          not a.profile_gpu_only, engine_kw, a.graph_size)
    configs = a.configs.split(",")
    unknown = sorted(c for c in configs if c not in CONFIGS and not KV_MATCHED.fullmatch(c))
    if unknown:
        sys.exit(f"unknown configs {unknown}; choose from {sorted(CONFIGS)} or none-kvN")
    t = time.time()
    write_model(model, SHAPES[a.shape])
    write_adapters(adapters, max(config_of(c)[0] for c in configs), SHAPES[a.shape],
                   TARGETS[a.targets][0], ranks, a.distinct)
    log(f"assets in {time.time() - t:.1f} s")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
    import vllm

    summary = {"gpu": gpu.strip(), "machine": machine_id(), "vllm": vllm.__version__,
               "commit": a.commit,
               "date": time.strftime("%Y-%m-%d"), "shape": a.shape, "targets": a.targets,
               "ranks": list(ranks), "distinct_weight_sets": a.distinct,
               "warm_adapters": a.warm_adapters, "pool_config": json.loads(a.pool_config),
               "engine_kw": engine_kw, "graph_size": a.graph_size,
               "copy_bw_bytes_s": round(copy_bandwidth()), "configs": {}}
    log(f"copy bandwidth {summary['copy_bw_bytes_s'] / 1e12:.2f} TB/s (read + write)")
    for c in configs:
        t = time.time()
        with open(os.path.join(a.out, f"{c}.log"), "w") as lf:
            env = {**os.environ, **config_env(c),
                   **({STEP_TRACE_ENV: os.path.join(a.out, f"{c}-steps")} if a.step_trace
                      else {}),
                   **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if a.profile else {})}
            rc = run_child([sys.executable, __file__, "--child", c, "--root", a.root,
                            "--shape", a.shape, "--targets", a.targets, "--ranks", a.ranks,
                            "--warm-adapters", str(a.warm_adapters), "--pool-config",
                            a.pool_config, "--engine-kw", a.engine_kw, "--graph-size",
                            a.graph_size, "--out", a.out, "--profile", str(a.profile),
                            *(["--profile-gpu-only"] if a.profile_gpu_only else [])],
                           env, lf, a.timeout_s)
        path = os.path.join(a.out, f"{c}.json")
        r = json.load(open(path)) if os.path.exists(path) else {}
        # A child that wrote its results measured them, even if it was then
        # stopped at the time limit while shutting down its engine.
        r.update(status="ok" if "out_tok_s" in r else f"failed ({rc})", exit=rc,
                 wall_s=round(time.time() - t, 1))
        summary["configs"][c] = r
        roofline(summary)
        log(f"{c}: {r['status']} start {r.get('engine_start_s')} s, gen {r.get('gen_s')} s, "
            f"{r.get('out_tok_s')} out tok/s, steps {r.get('engine_steps')}, "
            f"preempt {r.get('preemptions')}, LoRA {r.get('lora_ms_per_step')} ms/step, "
            f"roofline {r.get('roofline_ms_per_step')} ms/step "
            f"(efficiency {r.get('roofline_efficiency')}), pool {r.get('pool')}")
        if rc != 0:
            log(open(os.path.join(a.out, f"{c}.log"), errors="replace").read()[-2500:])
        json.dump(summary, open(os.path.join(a.out, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
