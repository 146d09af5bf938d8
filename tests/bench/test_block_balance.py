"""benchmarks/kernels/block_balance.py: the CPU model of how evenly a
grid-stride launch's programs share a step's work blocks, in slot order and
by decreasing rank (kernels/batch.py BLOCK_ORDER)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "kernels"))
import block_balance  # noqa: E402

sys.path.pop(0)


def test_makespan_runs_costs_in_order_on_the_first_free_worker():
    assert block_balance.makespan([3, 1, 1, 1], 2) == 3
    assert block_balance.makespan([1, 1, 1, 3], 2) == 4  # the heavy one last: a tail


@pytest.fixture(autouse=True)
def _restore_order(monkeypatch):
    from vllm_loraserve.kernels import batch

    monkeypatch.setattr(batch, "BLOCK_ORDER", batch.BLOCK_ORDER)  # the model sets it


def test_rank_order_evens_the_programs_of_the_e2e_decode_step():
    a = argparse.Namespace(shape="llama2-7b", adapters=1000, tokens=660,
                           ranks=[8, 16, 32, 64, 128], rank_step=16, overhead=1.0, sms=132,
                           slots=16)
    slot, rank = (block_balance.case(a, order, 0) for order in ("slot", "rank"))
    assert slot["blocks"] == rank["blocks"]
    for kind in ("qkv", "o"):
        assert slot[kind]["programs"] == rank[kind]["programs"]
        assert rank[kind]["max_over_mean"] < slot[kind]["max_over_mean"]
        assert rank[kind]["makespan_over_ideal"] < slot[kind]["makespan_over_ideal"]
