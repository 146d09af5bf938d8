"""The admission policies reorder vLLM's own FCFS queue: a permutation, each
group in queue order, and no request passed over more than `max_passes`
times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from vllm_loraserve.scheduler.admission import ADMISSIONS, AdapterAffinity, Fcfs

FCFS = SchedulingPolicy.FCFS


class Req:  # hashable by identity, as vLLM's Request
    def __init__(self, name: str, lora: int | None) -> None:
        self.request_id = name
        self.lora_request = None if lora is None else SimpleNamespace(lora_int_id=lora)


req = Req


def queue_of(*reqs):
    q = create_request_queue(FCFS)
    for r in reqs:
        q.add_request(r)
    return q


def names(q) -> str:
    return "".join(r.request_id for r in q)


def test_the_registry_names_both_policies():
    assert isinstance(ADMISSIONS["fcfs"](), Fcfs)
    assert isinstance(ADMISSIONS["affinity"](), AdapterAffinity)


def test_fcfs_leaves_vllms_order():
    q = queue_of(req("A", 1), req("B", 2), req("C", None))
    Fcfs().order(q, lambda i: i == 2, FCFS)
    assert names(q) == "ABC"


def test_requests_of_adapters_in_use_and_base_requests_go_first_in_queue_order():
    q = queue_of(req("A", 1), req("B", 2), req("C", None), req("D", 3), req("E", 2),
                 req("F", 4))
    AdapterAffinity().order(q, lambda i: i in (2, 4), FCFS)
    assert names(q) == "BCEFAD"
    assert sorted(names(q)) == list("ABCDEF")  # a permutation: nothing dropped


def test_nothing_moves_when_no_request_behind_goes_first():
    pol = AdapterAffinity(max_passes=1)
    q = queue_of(req("B", 2), req("A", 1), req("D", 3))
    for _ in range(3):  # never passed over, so never aged
        pol.order(q, lambda i: i == 2, FCFS)
        assert names(q) == "BAD"
    assert pol._passes == {"A": 0, "D": 0}


def test_a_request_passed_over_max_passes_times_goes_first():
    pol = AdapterAffinity(max_passes=2)
    q = queue_of(req("A", 1), req("B", 2))
    in_use = lambda i: i == 2  # noqa: E731
    pol.order(q, in_use, FCFS)
    assert names(q) == "BA"  # A passed over once
    q.remove_requests([q.peek_request()])  # B is admitted; C arrives
    q.add_request(req("C", 2))
    pol.order(q, in_use, FCFS)
    assert names(q) == "CA"  # twice
    q.remove_requests([q.peek_request()])
    q.add_request(req("D", 2))
    q.add_request(req("E", 5))
    pol.order(q, in_use, FCFS)
    assert names(q) == "ADE"  # A goes first now; E was behind D already: not passed over
    assert pol._passes == {"A": 2, "E": 0}
    q.remove_requests([q.peek_request()])  # A admitted: its count goes
    pol.order(q, in_use, FCFS)
    assert "A" not in pol._passes


@pytest.mark.parametrize("seed", range(5))
def test_random_steps_keep_the_invariants(seed):
    import random

    rng = random.Random(seed)
    pol, max_passes = AdapterAffinity(max_passes=3), 3
    q = queue_of()
    passed: dict[str, int] = {}
    n = 0
    for _ in range(200):
        for _ in range(rng.randint(0, 3)):
            q.add_request(req(f"r{n}", rng.choice([None, 1, 2, 3, 4, 5])))
            n += 1
        in_use_ids = set(rng.sample([1, 2, 3, 4, 5], rng.randint(0, 3)))
        before = list(q)
        pol.order(q, in_use_ids.__contains__, FCFS)
        after = list(q)
        assert sorted(r.request_id for r in after) == sorted(r.request_id for r in before)
        pos = {r.request_id: k for k, r in enumerate(before)}
        for r in after:  # each request counts the steps something behind it went ahead
            ahead = {x.request_id for x in after[:after.index(r)]}
            if any(pos[x] > pos[r.request_id] for x in ahead):
                passed[r.request_id] = passed.get(r.request_id, 0) + 1
            assert passed.get(r.request_id, 0) <= max_passes
        # two groups, each in queue order, and every preferred request in the first
        order = [pos[r.request_id] for r in after]
        k = next((i for i in range(1, len(order)) if order[i] < order[i - 1]), len(order))
        assert order[:k] == sorted(order[:k]) and order[k:] == sorted(order[k:])
        if k < len(order):
            assert all(r.lora_request is not None and r.lora_request.lora_int_id not in
                       in_use_ids for r in after[k:])
        for _ in range(rng.randint(0, 3)):  # admissions from the front
            if q:
                q.pop_request()
