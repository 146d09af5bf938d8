"""The long soak run of issue 11 (tests/e2e/test_soak.py runs a short one).

    python benchmarks/soak/run_soak.py --out benchmarks/soak/results/soak-cpu.json

Defaults: 2,000 requests over 200 adapters (100 in an adapter directory,
100 loaded and unloaded at runtime while the clients run), 16 concurrent
clients, half of the requests streamed and a tenth of those left mid-stream.
`--same-name-churn N` adds issue 22's race: N of the churned names also get
a load, an in-place reload and an unload at the same moment, every pause.
Prints the config and the figures, writes them as JSON, exits 1 if a pass
criterion is missed (vllm_loraserve/bench/soak.py says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile

from vllm_loraserve.bench.soak import SoakConfig, run_soak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(SoakConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--workdir", help="assets and server log (default: a temporary directory)")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args()
    cfg = SoakConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(SoakConfig)})
    import vllm

    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "vllm": vllm.__version__}
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print("config:", json.dumps(dataclasses.asdict(cfg)), "\nmachine:", json.dumps(machine),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="loraserve-soak-") as tmp:
        result = run_soak(cfg, a.workdir or tmp, progress=True)
    summary = {k: v for k, v in dataclasses.asdict(result).items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    print(f"{'PASSED' if result.passed else 'FAILED'}: {cfg.requests} requests in "
          f"{result.seconds:.0f} s, RSS {result.rss_q2_mb:.0f} MiB (2nd quarter) -> "
          f"{result.rss_q4_mb:.0f} MiB (last), {100 * result.rss_growth:+.2f}%")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "started_utc": started,
                       "machine": machine, **dataclasses.asdict(result),
                       "passed": result.passed}, f, indent=1)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
