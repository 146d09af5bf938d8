"""The soak test, short: runtime churn (also same-name load/reload/unload at
once), clients leaving mid-stream, and the pass criteria of the long run
(benchmarks/soak/run_soak.py)."""

from __future__ import annotations

import pytest

from vllm_loraserve.bench.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def test_soak_short(tmp_path):
    cfg = SoakConfig(requests=240, adapters=24, concurrency=8, churn_pause_s=0.05,
                     same_name_churn=3)
    result = run_soak(cfg, str(tmp_path))
    assert result.passed, (result.failures, result.bad[:10], result.churn, result.statuses)
    # the run did what it claims: churn (also of the same names at once), refusals
    # that say why, clients that left, every view agreeing at the end
    assert result.churn.get("load 200", 0) >= 5 and result.churn.get("unload 200", 0) >= 3
    assert result.churn.get("reload 200", 0) >= 3, result.churn
    assert result.churn.get("load 400 race", 0) + result.churn.get("unload 404 race", 0) >= 3
    assert result.end_state == []
    assert result.outcomes.get("disconnected", 0) >= 1
    assert result.outcomes["ok"] >= cfg.requests // 2
    assert all(key.startswith("4") for key in result.refusals), result.refusals
