#!/usr/bin/env python3
"""docs/benchmarks/e2e-summary.json from the raw results of an acceptance run.

    python3 benchmarks/e2e/summary.py results/DIR/*offline*.json \
        --out docs/benchmarks/e2e-summary.json

Each input is a bench_e2e.py results.json. One object per config, keyed by
the config's name (`pool-100`, ...), or `name@shape/targets` for a run of
another shape or target set than the default (llama2-7b, qkvo): its out
tok/s, ratio to the `none` of the same results file (same machine, same
call), roofline efficiency where the pool measured it, and the run's device,
vLLM, commit and date, and `off_protocol` where the run used bench_e2e.py's
diagnostic flags (`--warm-adapters`, `--pool-config`, `--engine-kw`, `--graph-size`;
a run from before `--graph-size` had vLLM's default graphs, up to 512 tokens). Nothing is
typed by hand; a config measured twice is an error (say which run counts by passing
only that one). A results file without a `none` takes the `none` of another file from
the same machine boot (bench_e2e.py's `machine`) and protocol: the calls of one warm
device machine share one baseline (`none_shared` in its configs).
"""

from __future__ import annotations

import argparse
import copy
import json

from bench_e2e import KV_MATCHED_KEYS, PROTOCOL, roofline, same_graphs

DEFAULT = ("llama2-7b", "qkvo")


def _before(run: dict, key: str, default):
    """A protocol key of a run from before bench_e2e.py recorded it: such runs
    had vLLM's graphs (512 tokens) unless --engine-kw gave a size."""
    if key != "graph_size":
        return default
    kw = run.get("engine_kw") or {}
    size = kw.get("max_cudagraph_capture_size") or (kw.get("compilation_config") or {}).get(
        "max_cudagraph_capture_size")
    return str(size or 512)


def _protocol(run: dict) -> str:
    return json.dumps({k: run.get(k) for k in ("machine", "shape", "targets", *PROTOCOL)},
                      sort_keys=True)


def share_none(runs: list[dict]) -> list[dict]:
    """Give each run without a measured `none` the one of the same machine
    boot and protocol; compute every run's LoRA times against its `none`
    (`roofline`). Runs from before bench_e2e.py recorded the machine keep
    no baseline."""
    nones: dict[str, list[dict]] = {}
    for run in runs:
        if run.get("machine") and "out_tok_s" in run["configs"].get("none", {}):
            nones.setdefault(_protocol(run), []).append(run["configs"]["none"])
    out = []
    for run in runs:
        if "out_tok_s" in run["configs"].get("none", {}):
            run = copy.deepcopy(run)
            roofline(run)  # again: results files from before a field was added lack it
            out.append(run)
            continue
        if not run.get("machine"):
            out.append(run)
            continue
        found = nones.get(_protocol(run), [])
        if len(found) > 1:
            raise SystemExit(f"{len(found)} `none` runs on machine {run['machine']}: pass one")
        if not found:
            out.append(run)
            continue
        run = copy.deepcopy(run)
        run["configs"]["none"] = copy.deepcopy(found[0])
        roofline(run)
        for r in run["configs"].values():
            r["none_shared"] = True
        out.append(run)
    return out


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for run in share_none(runs):
        shape = (run.get("shape", DEFAULT[0]), run.get("targets", DEFAULT[1]))
        none_run = run["configs"].get("none", {})
        none = none_run.get("out_tok_s")
        for name, r in run["configs"].items():
            # Measured: the child wrote its results (an older bench_e2e.py
            # marked one stopped at the time limit during shutdown as failed).
            if "out_tok_s" not in r or name == "none":
                continue
            key = name if shape == DEFAULT else f"{name}@{shape[0]}/{shape[1]}"
            if key in out:
                raise SystemExit(f"{key} is in two runs: pass one of them")
            out[key] = {
                "out_tok_s": r["out_tok_s"],
                # Only against a `none` with the same CUDA graphs (bench_e2e.py).
                "ratio_to_none": round(r["out_tok_s"] / none, 3)
                if none and same_graphs(r, none_run) else None,
                "roofline_efficiency": r.get("roofline_efficiency"),
                "lora_ms_per_step": r.get("lora_ms_per_step"),
                "adapter_bytes_per_step": r.get("adapter_bytes_per_step"),
                "steps_vs_none": r.get("steps_vs_none"),
                "extra_ms_per_step": r.get("extra_ms_per_step"),
                "roofline_efficiency_total": r.get("roofline_efficiency_total"),
                "roofline_ratio": r.get("roofline_ratio"),
                "device": run["gpu"], "vllm": run.get("vllm"), "commit": run.get("commit"),
                "date": run.get("date"), "ranks": run.get("ranks"),
                **({"none_shared": True} if r.get("none_shared") else {}),
                **{k: r[k] for k in KV_MATCHED_KEYS if k in r}}
            # A run off the protocol's defaults says so (bench_e2e.py's
            # diagnostic flags): its numbers are not the protocol's.
            given = {k: run[k] if k in run else _before(run, k, default)
                     for k, default in PROTOCOL.items()}
            off = {k: v for k, v in given.items() if v != PROTOCOL[k]}
            if off:
                out[key]["off_protocol"] = off
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="bench_e2e.py results.json files")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    summary = summarize([json.load(open(p)) for p in a.results])
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    for key, r in sorted(summary.items()):
        print(f"{key}: {r['ratio_to_none']} of none, roofline efficiency "
              f"{r['roofline_efficiency']}")


if __name__ == "__main__":
    main()
