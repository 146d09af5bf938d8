"""benchmarks/train/bench_train.py runs at toy shapes on the CPU, every mode,
and its JSON holds what docs/benchmarks/train.md reports."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "benchmarks", "train", "bench_train.py")


def test_bench_train_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "train.json"
    bench.main(["--tiny", "--train-frac", "0.5", "--out", str(out)])
    rows = json.load(open(out))["rows"]
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"loraserve", "loraserve-reprefill", "peft-solo", "peft-padded"}
    # 4 training samples of 10 tokens and 4 inference samples of 3 new tokens.
    for mode in ("loraserve", "loraserve-reprefill", "peft-solo"):
        assert by_mode[mode]["tokens"] == 4 * 10 + 4 * 3
        assert by_mode[mode]["tokens_per_s"] > 0
    assert "not supported by PEFT" in by_mode["peft-padded"]["result"]
