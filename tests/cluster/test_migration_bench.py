"""benchmarks/cluster/migration_bench.py on CPU: tcp between two processes,
nixl reported unavailable (no NIXL or GPU here), the JSON complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_migration_bench_smoke(tmp_path):
    out = tmp_path / "m.json"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cluster",
                                                 "migration_bench.py"),
                    "--transports", "tcp,nixl", "--ranks", "1,2", "--reps", "1",
                    "--out", str(out)], check=True, env=env, timeout=300, cwd=tmp_path)
    d = json.loads(out.read_text())
    rows = d["transports"]["tcp"]["rows"]
    assert [(r["rank"], r["bytes"] > 2 * 4096 * 2 * 32 * 4 * r["rank"]) for r in rows] == [
        (1, True), (2, True)]
    assert all(r["median_s"] > 0 and r["median_gb_s"] > 0 for r in rows)
    assert d["transports"]["nixl"] == {
        "unavailable": "nixl transport unavailable (No module named 'nixl'): using tcp"}
    assert d["date"] and d["command"] and d["device"] == "cpu"
    assert d["versions"]["nixl"] == "not installed"
