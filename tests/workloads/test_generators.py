"""Generator statistics within stated tolerances, and determinism by seed."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from vllm_loraserve.adapters.record import AdapterRecord, read_catalog, write_catalog
from vllm_loraserve.workloads import generators as g
from vllm_loraserve.workloads.trace import Request, read_trace, write_trace


def _gaps(requests):
    t = np.array([r.arrival_s for r in requests])
    return np.diff(np.concatenate([[0.0], t]))


@pytest.mark.parametrize("rate, cv", [(5.0, 1.0), (20.0, 0.5), (8.0, 3.0)])
def test_slora_rate_and_cv(rate, cv):
    _, reqs = g.slora(50, rate=rate, cv=cv, duration=40000 / rate, seed=1)
    gaps = _gaps(reqs)
    assert len(reqs) == 40000  # int(rate * duration), as S-LoRA
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.05)  # total rate within 5%
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)  # cv within 5%


@pytest.mark.parametrize("alpha", [0.3, 0.6, 1.0, 2.0])
def test_slora_power_exponent_recovered(alpha):
    """Maximum likelihood of the exponent from adapter popularity: adapter k
    of n has probability ((k+1)/n)^alpha - (k/n)^alpha."""
    n = 100
    _, reqs = g.slora(n, alpha=alpha, rate=100, duration=200, seed=2)
    counts = np.bincount([int(r.adapter.split("-")[1]) for r in reqs], minlength=n)
    edges = np.arange(n + 1) / n
    grid = np.linspace(0.05, 4.0, 3951)  # steps of 0.001
    probs = edges[1:][None, :] ** grid[:, None] - edges[:-1][None, :] ** grid[:, None]
    loglik = (counts[None, :] * np.log(np.maximum(probs, 1e-300))).sum(axis=1)
    assert grid[loglik.argmax()] == pytest.approx(alpha, rel=0.05)


def test_slora_ranks_round_robin_and_lengths():
    catalog, reqs = g.slora(7, ranks=(8, 64), input_range=(10, 20), output_range=(3, 5), seed=3)
    assert [a.rank for a in catalog] == [8, 64, 8, 64, 8, 64, 8]
    assert all(10 <= r.prompt_len < 20 and 3 <= r.output_len < 5 for r in reqs)
    assert all(r.rank == int(r.adapter.rsplit("-r", 1)[1]) for r in reqs)


def test_same_seed_same_trace_other_seed_other_trace(tmp_path):
    for kind, make in (("slora", lambda s: g.slora(20, rate=5, duration=30, seed=s)),
                       ("loraserve", lambda s: g.loraserve(25, popularity="shifting", rate=5,
                                                           duration=30, seed=s)),
                       ("azure", lambda s: g.azure(25, rate=5, duration=60, seed=s))):
        write_trace(tmp_path / "a.jsonl", make(7)[1])
        write_trace(tmp_path / "b.jsonl", make(7)[1])
        write_trace(tmp_path / "c.jsonl", make(8)[1])
        a, b, c = ((tmp_path / f"{x}.jsonl").read_bytes() for x in "abc")
        assert a == b, kind
        assert a != c, kind


def _rank_share(reqs, rank, lo, hi):
    t_end = reqs[-1].arrival_s
    window = [r for r in reqs if lo * t_end <= r.arrival_s < hi * t_end]
    return sum(r.rank == rank for r in window) / len(window)


def test_shifting_skew_shape():
    _, reqs = g.loraserve(100, popularity="shifting", rate=200, duration=300, seed=4)
    # rank 128's share goes from 0.5 to 0.125 linearly; rank 8's the other way.
    # Mean share over the first / last 10% of the trace: 0.5 - 0.05 * 0.375.
    assert _rank_share(reqs, 128, 0.0, 0.1) == pytest.approx(0.48125, abs=0.02)
    assert _rank_share(reqs, 8, 0.0, 0.1) == pytest.approx(0.14375, abs=0.02)
    assert _rank_share(reqs, 8, 0.9, 1.0) == pytest.approx(0.48125, abs=0.02)
    assert _rank_share(reqs, 128, 0.9, 1.0) == pytest.approx(0.14375, abs=0.02)
    assert _rank_share(reqs, 32, 0.45, 0.55) == pytest.approx(0.125, abs=0.02)


def test_rank_popularities_and_power_law_within_rank():
    _, reqs = g.loraserve(100, popularity="exponential", rate=500, duration=120, seed=5)
    counts = Counter(r.rank for r in reqs)
    for small, big in ((8, 16), (16, 32), (32, 64)):
        assert counts[small] / counts[big] == pytest.approx(2.0, rel=0.1)
    within = Counter(r.adapter for r in reqs if r.rank == 8)
    assert within["r8-000"] / within["r8-001"] == pytest.approx(2.0, rel=0.1)  # (j+1)^-1
    assert within["r8-000"] / within["r8-003"] == pytest.approx(4.0, rel=0.15)
    _, reqs = g.loraserve(100, popularity="powerlaw", rank_alpha=2.0, rate=500, duration=120,
                          seed=6)
    counts = Counter(r.rank for r in reqs)
    assert counts[8] / counts[16] == pytest.approx(4.0, rel=0.1)  # (1/2)^-2


def test_uniform_arrivals_are_evenly_spaced():
    _, reqs = g.loraserve(10, arrival="uniform", rate=4, duration=10)
    assert np.allclose(_gaps(reqs), 0.25)


def test_azure_rescaling_keeps_the_pattern():
    secs, prompts, outputs = g.read_azure(g.AZURE_CONV)
    _, reqs = g.azure(50, rate=2.0, seed=1)
    t = np.array([r.arrival_s for r in reqs])
    assert len(reqs) == len(secs) == 19366
    assert (len(t) - 1) / t[-1] == pytest.approx(2.0, rel=1e-9)  # mean rate is the target
    assert np.allclose(t / t[-1], secs / secs[-1])  # same arrival pattern, rescaled
    assert [r.prompt_len for r in reqs] == prompts.tolist()
    assert [r.output_len for r in reqs] == np.maximum(outputs, 1).tolist()
    _, cut = g.azure(50, rate=2.0, duration=100, max_prompt_len=300, max_output_len=50)
    assert cut[-1].arrival_s <= 100 and max(r.prompt_len for r in cut) <= 300


def test_trace_and_catalog_files(tmp_path):
    reqs = [Request(0, 0.5, "a", 8, 10, 2), Request(1, 0.7, "b", 16, 4, 9)]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == reqs
    write_trace(tmp_path / "bad.jsonl", reversed(reqs))
    with pytest.raises(ValueError, match="arrivals must not decrease"):
        read_trace(tmp_path / "bad.jsonl")
    write_catalog(tmp_path / "c.json", [AdapterRecord("a", 8)])
    assert read_catalog(tmp_path / "c.json") == [AdapterRecord("a", 8)]
    (tmp_path / "dup.json").write_text(json.dumps([{"name": "a", "rank": 8}] * 2))
    with pytest.raises(ValueError, match="unique"):
        read_catalog(tmp_path / "dup.json")


def test_cli_gen(tmp_path):
    from vllm_loraserve.cli.main import main

    out = tmp_path / "s.jsonl"
    main(["bench", "gen", "--kind", "slora", "--out", str(out), "--num-adapters", "5",
          "--rate", "2", "--duration", "10", "--alpha", "0.5", "--cv", "2"])
    assert len(read_trace(out)) == 20
    assert len(read_catalog(tmp_path / "s.adapters.json")) == 5
