"""Where in a timed run the GPU waited, second by second, beside what the
pool's steps did in that second: from bench_e2e.py's results (a config's
`pacing.gpu_idle_by_second` and `timed_mono`) and its step trace
(--step-trace, worker/step_trace.py).

    python3 benchmarks/e2e/step_timeline.py DIR --config pool-1000 \
        --baseline none-kv11770 --out timeline.json

DIR holds the run's results.json (or a device call's offline.json) and the
config's step trace files, `<config>-steps-*.jsonl` (in a device call's
offline-files.tgz). For each second of the timed run: the baseline's and
the config's GPU idle share (NVML's readings lag by up to their sample
period: bench_e2e.Pacing), and the config's steps that started in that
second: their count, tokens, page loads, and sums of host, apply, CPU,
gap, gap CPU, process CPU and garbage-collection seconds, full collections
and cudaFrees, and the other threads' CPU seconds by name. Printed as a
table, saved as JSON with the idle seconds of each config in all.
"""

from __future__ import annotations

import argparse
import json
import os

from bench_e2e import read_step_trace

SUMS = ("tokens", "loads", "host_s", "apply_s", "apply_cpu_s", "cpu_s", "gap_s", "gap_cpu_s",
        "proc_cpu_s", "gc_s", "gc_full", "device_frees")


def load_configs(directory: str) -> dict:
    for name in ("results.json", "offline.json"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)["configs"]
    raise SystemExit(f"no results.json or offline.json in {directory}")


def timeline(configs: dict, lines: list[dict], config: str, baseline: str | None) -> dict:
    """Per second of `config`'s timed run, the idle shares and its steps
    (trace lines that started within the run), and the idle seconds in all.
    A second's idle share is None where no NVML sample fell in it."""
    run = configs[config]
    if "timed_mono" not in run:
        raise SystemExit(f"{config}'s results have no timed_mono: a bench_e2e.py from before "
                         "the step timeline")
    start, end = run["timed_mono"]
    idle = run["pacing"].get("gpu_idle_by_second", [])
    base = configs[baseline]["pacing"].get("gpu_idle_by_second", []) if baseline else []
    steps = [r for r in lines if start <= r["mono"] <= end]
    seconds = max(len(idle), len(base), int(end - start) + 1)
    rows = [{"second": s, "idle": idle[s] if s < len(idle) else None,
             "baseline_idle": base[s] if s < len(base) else None, "steps": 0,
             **dict.fromkeys(SUMS, 0), "threads_cpu_s": {}} for s in range(seconds)]
    for r in steps:
        row = rows[int(r["mono"] - start)]
        row["steps"] += 1
        for k in SUMS:
            row[k] += r.get(k) or 0
        for name, cpu_s in (r.get("threads_cpu_s") or {}).items():
            row["threads_cpu_s"][name] = row["threads_cpu_s"].get(name, 0) + cpu_s
    for row in rows:
        for k in SUMS:
            if isinstance(row[k], float):
                row[k] = round(row[k], 4)
        row["threads_cpu_s"] = {k: round(v, 4) for k, v in row["threads_cpu_s"].items()}

    def total(shares: list) -> float:
        return round(sum(x for x in shares if x is not None), 3)

    return {"config": config, "baseline": baseline, "idle_s": total(idle),
            "baseline_idle_s": total(base) if baseline else None, "seconds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--config", required=True)
    ap.add_argument("--baseline", help="a config of the same call (e.g. none-kv11770)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = timeline(load_configs(a.dir), read_step_trace(os.path.join(a.dir, f"{a.config}-steps")),
                   a.config, a.baseline)
    cols = ("second", "baseline_idle", "idle", "steps", *SUMS)
    print(" ".join(f"{c:>12}" for c in cols), "  other threads' CPU s")
    for row in out["seconds"]:
        print(" ".join(f"{'-' if row[c] is None else row[c]:>12}" for c in cols), " ",
              ", ".join(f"{k} {v}" for k, v in sorted(row["threads_cpu_s"].items(),
                                                      key=lambda kv: -kv[1])[:3]))
    print(f"idle seconds: {a.config} {out['idle_s']}, {a.baseline} {out['baseline_idle_s']}")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
