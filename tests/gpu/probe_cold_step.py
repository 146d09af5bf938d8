"""Where the host waits in a cpu-assist load step on a GPU: a diagnostic,
not a test. Runs the modes' e2e case (test_cold_start_gpu.py) in cpu-assist
mode only, once with CUDA's lazy module loading (the default) and once with
CUDA_MODULE_LOADING=EAGER, each with slow_side.py's probe, and each with
the warm round (the probe's lines show both rounds' load steps):

    LORASERVE_RESULTS_DIR=$OUT [PROBE_LOADING=EAGER] python3 tests/gpu/probe_cold_step.py

The probe lines (slow_side-<pid>.jsonl) and a summary (probe_cold_step.json)
go to $LORASERVE_RESULTS_DIR.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.reference import run_vllm  # noqa: E402
from tests.gpu.case import MAX_TOKENS, build_case  # noqa: E402
from tests.gpu.test_cold_start_gpu import DELAY_CYCLES, ENGINE  # noqa: E402


def main() -> None:
    out_dir = os.environ["LORASERVE_RESULTS_DIR"]
    root = Path(tempfile.mkdtemp(prefix="probe-cold-"))
    model, reqs = build_case(root / "case")
    summary = {}
    for loading in os.environ.get("PROBE_LOADING", "LAZY,EAGER").split(","):
        run_dir = root / loading
        run_dir.mkdir()
        engine = {**ENGINE, "additional_config": {"loraserve": {
            "cold_start": "cpu-assist", "cold_start_group_layers": 1}}}
        run = run_vllm(run_dir, model, reqs, engine, MAX_TOKENS,
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                            "CUDA_MODULE_LOADING": loading},
                       dtype="bfloat16", script="../gpu/slow_side.py",
                       delay_cycles=DELAY_CYCLES, warm_round=True)
        summary[loading] = {"warm_round": run["warm_residency"]["pool"],
                            "both_rounds": run["residency"]["pool"]}
        print(loading, {r: {k: p[k] for k in ("pipelined_groups", "assisted_groups")}
                        for r, p in summary[loading].items()}, flush=True)
    json.dump(summary, open(os.path.join(out_dir, "probe_cold_step.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
