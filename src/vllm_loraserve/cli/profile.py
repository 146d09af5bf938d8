"""`loraserve profile`: measure an engine and write a profile file."""

from __future__ import annotations

import argparse
import json
import os

from vllm_loraserve.perf.model import KINDS


def _profile(a: argparse.Namespace) -> None:
    from vllm import LLM

    from vllm_loraserve.adapters.directory import scan_adapter_dir
    from vllm_loraserve.adapters.peft import inspect_adapter
    from vllm_loraserve.perf.profiler import design, profile_engine

    specs = {}
    for name, path in scan_adapter_dir(a.adapter_dir):
        spec = inspect_adapter(path)
        specs.setdefault(spec.rank, (name, spec))
    if not specs:
        raise SystemExit(f"no adapters in {a.adapter_dir}")
    ranks = sorted(specs)
    engine_args = {"dtype": "float32", "max_model_len": 1024, **json.loads(a.engine_args)}
    dtype_bytes = 4 if engine_args["dtype"] in ("float32", "float") else 2
    per_rank = {r: sum(m.in_features + m.out_features for m in s.modules.values()) * dtype_bytes
                for r, (_, s) in specs.items()}
    if a.plugin:
        engine_args.setdefault("additional_config", {})["loraserve"] = {}
    llm = LLM(model=a.model, enable_lora=True, max_lora_rank=max(ranks), max_loras=len(ranks),
              max_cpu_loras=len(ranks), seed=0, **engine_args)
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    max_seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    points = design(ranks, [b for b in a.batch_sizes if b <= max_seqs], a.prompt_lens, budget)
    profile = profile_engine(
        llm, {r: (n, s.path) for r, (n, s) in specs.items()}, kind=a.kind, points=points,
        repeats=a.repeats, adapter_bytes_per_rank=max(per_rank.values()),
        slo_ttft_p95_s=a.ttft_slo,
        source=(f"loraserve profile of {os.path.abspath(a.model)} "
                f"({'plugin' if a.plugin else 'stock'} vLLM, "
                f"{json.dumps(engine_args, sort_keys=True)})"),
        samples_path=os.path.splitext(a.out)[0] + ".samples.json")
    profile.save(a.out)
    print(f"wrote {a.out}: step model {dict(profile.step.coef)}, R^2 {profile.fit_r2}, "
          f"operating points (tokens/s) {profile.operating_points}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure an engine's step latency and fit a profile",
                       description="Measure prefill and decode steps of a vLLM engine with "
                                   "controlled batches of adapters of every rank, fit the "
                                   "step model and derive operating points "
                                   "(see vllm_loraserve/perf/profiler.py).")
    p.add_argument("--model", required=True)
    p.add_argument("--adapter-dir", required=True,
                   help="PEFT adapters; one of each rank found is used")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--kind", choices=KINDS, default="mbgmv",
                   help="LoRA term of the model (mbgmv: sum of ranks; bgmv: padded)")
    p.add_argument("--plugin", action="store_true", help="measure with --plugin loraserve")
    p.add_argument("--engine-args", default="{}", help="JSON of extra vllm.LLM arguments")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-slo", type=float, default=10.0,
                   help="P95 TTFT SLO (s) for the operating points")
    p.set_defaults(func=_profile)
