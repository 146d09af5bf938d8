"""benchmarks/cold_start/ttft_bench.py without a GPU: its request sequence
against a fake server (residency listing and streamed completions), the
medians and ratios it reports, and the plugin flags online_ttft.py gives a
cold-start mode."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "ttft_bench", os.path.join(ROOT, "benchmarks", "cold_start", "ttft_bench.py"))
ttft_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttft_bench)
online_ttft = ttft_bench.online_ttft  # the copy ttft_bench imported

URL = "http://fake"


class FakeServer:
    """The plugin server as ttft_bench sees it: an adapter is on disk until
    its first completion, on the device after; in-flight completions counted."""

    def __init__(self, ranks: dict[str, int]) -> None:
        self.ranks = ranks
        self.residency = dict.fromkeys(ranks, "disk")
        self.requests: list[dict] = []  # completion bodies, in arrival order
        self.inflight = self.max_inflight = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/loraserve/v1/adapters":
            return httpx.Response(200, json={"adapters": [
                {"name": n, "rank": r, "status": "ready", "residency": self.residency[n]}
                for n, r in self.ranks.items()]})
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        self.requests.append(body)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        await asyncio.sleep(0.005)  # long enough for a batch's requests to overlap
        self.inflight -= 1
        if body["model"] in self.residency:
            self.residency[body["model"]] = "device"
        chunks = [{"choices": [{"text": "w5"}]}] * body["max_tokens"] + [
            {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode())


def options(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(prompts=[4, 16], ranks=[8, 32], reps=2,
                                        concurrent=[1, 3], max_tokens=2, seed=0), **kw})


def run_fake(a: argparse.Namespace, per_rank_extra: int = 0):
    needed = ttft_bench.names_per_rank(a.prompts, a.reps, a.concurrent)
    # name i has rank ranks[i % len], as write_adapters lays them out
    served = {f"a{i:04d}": a.ranks[i % len(a.ranks)]
              for i in range(len(a.ranks) * (needed + per_rank_extra))}
    fake = FakeServer(served)
    names = ttft_bench.names_by_rank(served, a.ranks, needed)
    records: list[dict] = []
    cells: list[int] = []

    async def go() -> None:
        transport = httpx.MockTransport(fake.handle)
        async with httpx.AsyncClient(transport=transport) as client:
            await ttft_bench.measure(client, URL, names, a, records,
                                     lambda: cells.append(len(records)))

    asyncio.run(go())
    return fake, names, records, cells


def test_sequence_cold_names_fresh_cached_resident_batches_of_n():
    a = options()
    fake, names, records, cells = run_fake(a, per_rank_extra=2)
    # every request of the run is in the records, with a TTFT
    assert len(records) == len(fake.requests)
    assert all(r["error"] is None and r["ttft_s"] is not None for r in records)
    # prompts of exactly L token ids in the vocabulary, max_tokens as asked
    for body, r in zip(fake.requests, records, strict=True):
        assert body["model"] == r["model"] and len(body["prompt"]) == r["prompt_len"]
        assert all(4 <= t < 32000 for t in body["prompt"]) and body["max_tokens"] == 2
    # measured requests: cold ones found their adapter on disk, cached ones on
    # the device, so every one counts
    measured = [r for r in records if r["kind"] in ttft_bench.EXPECTED]
    assert measured and all(ttft_bench.counted(r) for r in measured)
    # no cold name is requested twice, and none before its cold request
    cold = [r["model"] for r in records if r["kind"] in ("cold", "warmup-cold")]
    assert len(cold) == len(set(cold))
    # exactly names_per_rank names per rank are used (the extra ones are not)
    used = {r["model"] for r in records if r["kind"] != "warmup-base"}
    for rank, ns in names.items():
        assert {m for m in used if fake.ranks[m] == rank} == set(ns)
    # a batch's N requests overlap; batches do not
    assert fake.max_inflight == max(a.concurrent)
    # one on_cell per (prompt length, rank); the cells have reps * N of each kind
    assert len(cells) == len(a.prompts) * len(a.ranks) and cells[-1] == len(records)
    agg = ttft_bench.aggregate(records)
    assert [(c["rank"], c["prompt_len"], c["concurrent"]) for c in agg] == sorted(
        (r, p, n) for r in a.ranks for p in a.prompts for n in a.concurrent)
    for c in agg:
        for kind in ("cached", "cold"):
            assert c[kind]["n"] == a.reps * c["concurrent"] and c[kind]["left_out"] == 0


def test_names_by_rank_refuses_too_few():
    served = {"a0000": 8, "a0001": 32, "a0002": 8}
    assert ttft_bench.names_by_rank(served, [8], 2) == {8: ["a0000", "a0002"]}
    with pytest.raises(RuntimeError, match="too few adapters of ranks {32: 1}"):
        ttft_bench.names_by_rank(served, [8, 32], 2)


def _rec(kind: str, ttft: float | None, *, rank: int = 8, length: int = 128, n: int = 1,
         where: str | None = None, error: str | None = None) -> dict:
    return {"kind": kind, "model": "m", "rank": rank, "prompt_len": length, "concurrent": n,
            "rep": 0, "residency_before": where or ttft_bench.EXPECTED.get(kind),
            "ttft_s": ttft, "e2e_s": ttft, "error": error}


def test_aggregate_medians_ratio_and_left_out():
    records = [
        _rec("cached", 0.010), _rec("cached", 0.030), _rec("cached", 0.020),
        # an all-cached request whose adapter had been evicted is not all-cached
        _rec("cached", 0.500, where="host"),
        _rec("cold", 0.100), _rec("cold", 0.300), _rec("cold", None, error="HTTP 500"),
        _rec("cold", 0.200),
        # warm-up kinds are not measured
        _rec("warmup-cold", 9.0), _rec("warmup", 9.0),
        # another cell: only cold requests answered
        _rec("cold", 0.4, length=512), _rec("cached", None, length=512, error="timeout"),
    ]
    cells = ttft_bench.aggregate(records)
    assert [(c["rank"], c["prompt_len"], c["concurrent"]) for c in cells] == [
        (8, 128, 1), (8, 512, 1)]
    c = cells[0]
    assert c["cached"] == {"n": 4, "left_out": 1, "ttft_s_median": 0.020}
    assert c["cold"] == {"n": 4, "left_out": 1, "ttft_s_median": 0.200}
    assert c["cold_over_cached"] == pytest.approx(10.0)
    c = cells[1]
    assert c["cached"] == {"n": 1, "left_out": 1, "ttft_s_median": None}
    assert c["cold"]["ttft_s_median"] == 0.4 and c["cold_over_cached"] is None


def test_combine_rows_in_mode_order_without_requests(tmp_path):
    cells = ttft_bench.aggregate([_rec("cached", 0.02), _rec("cold", 0.05)])
    modes = [{"mode": "cpu-assist", "status": "ok", "start_s": 80.0, "cells": cells,
              "requests": [{}]},
             {"mode": "block", "status": "ok", "cells": cells, "requests": [{}]},
             {"mode": "pipelined", "status": "failed: RuntimeError: boom", "requests": []}]
    out = ttft_bench.combine(modes)
    assert list(out["modes"]) == ["block", "pipelined", "cpu-assist"]
    assert all("requests" not in m for m in out["modes"].values())
    assert out["modes"]["pipelined"]["status"].startswith("failed")
    assert [r["mode"] for r in out["rows"]] == ["block", "cpu-assist"]
    assert out["rows"][0] == {"mode": "block", "rank": 8, "prompt_len": 128, "concurrent": 1,
                              "cached_ttft_s": 0.02, "cold_ttft_s": 0.05,
                              "cold_over_cached": pytest.approx(2.5)}
    text = ttft_bench.table(out["rows"])
    assert "20.0" in text and "50.0" in text and "2.50" in text
    # ttft.json gathers every ttft-MODE.json in the directory, earlier runs' too
    for m in modes:
        json.dump(m, open(tmp_path / f"ttft-{m['mode']}.json", "w"))
    assert ttft_bench.write_combined(str(tmp_path)) == json.loads(
        json.dumps(out)) == json.load(open(tmp_path / "ttft.json"))


def test_names_per_rank():
    # resident (largest N) + per prompt length: one warm-up cold name and
    # reps * sum(N) measured cold names
    assert ttft_bench.names_per_rank([128, 512, 2048], 3, [1]) == 1 + 3 * (1 + 3)
    assert ttft_bench.names_per_rank([128], 2, [1, 4]) == 4 + 1 * (1 + 2 * 5)


def test_online_plugin_flags_only_on_plugin_configs(tmp_path):
    root = str(tmp_path)
    flags = ["--loraserve-read-pause", "off"]
    assert online_ttft.server_args("pool-1000", root, flags=flags)[-2:] == flags
    assert not set(flags) & set(online_ttft.server_args("stock-100", root, flags=flags))
    assert online_ttft.server_args("none", root, flags=flags) == []
    cmd = online_ttft.server_args("pool-100", root, "pipelined")
    assert cmd[cmd.index("--loraserve-cold-start") + 1] == "pipelined"
    assert "--loraserve-cold-start" not in online_ttft.server_args("pool-100", root)
    assert "--loraserve-cold-start" not in online_ttft.server_args("stock-100", root, "block")
    assert online_ttft.server_args("none", root, "block") == []
    served = cmd[cmd.index("--loraserve-adapter-dir") + 1]
    assert sorted(os.listdir(served)) == [f"a{i:04d}" for i in range(100)]
    assert os.readlink(os.path.join(served, "a0007")) == os.path.join(root, "names", "a0007")
    assert set(online_ttft.COLD_STARTS) == {"block", "pipelined", "cpu-assist"}
