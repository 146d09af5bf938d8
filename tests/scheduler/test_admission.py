"""The admission policies reorder vLLM's own FCFS queue: a permutation, each
group in queue order, and a request passed over at the front within
`max_wait_steps` steps in the queue."""

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


def always(_rid: str) -> bool:
    return True


def in_use(*ids):
    """preferred(): no adapter, or one of `ids` (a running request uses it)."""
    return lambda r: r.lora_request is None or r.lora_request.lora_int_id in ids


def test_fcfs_leaves_vllms_order():
    q = queue_of(req("A", 1), req("B", 2), req("C", None))
    Fcfs().order(q, in_use(2), always, FCFS)
    assert names(q) == "ABC"


def test_preferred_requests_go_first_in_queue_order():
    q = queue_of(req("A", 1), req("B", 2), req("C", None), req("D", 3), req("E", 2),
                 req("F", 4))
    AdapterAffinity().order(q, in_use(2, 4), always, FCFS)
    assert names(q) == "BCEFAD"
    assert sorted(names(q)) == list("ABCDEF")  # a permutation: nothing dropped


def test_nothing_moves_when_no_request_behind_goes_first():
    pol = AdapterAffinity(max_wait_steps=1)
    q = queue_of(req("B", 2), req("A", 1), req("D", 3))
    for _ in range(3):  # never passed over: no clock runs
        pol.order(q, in_use(2), always, FCFS)
        assert names(q) == "BAD"
    assert pol._clock == {}


def test_a_passed_request_goes_to_the_front_after_max_wait_steps_in_the_queue():
    """One reordering puts many requests ahead of A for good: A's clock runs
    in every later step (not only when something moves ahead again), and A
    then goes ahead of every preferred request."""
    pol = AdapterAffinity(max_wait_steps=2)
    q = queue_of(req("A", 1), *(req(f"{i}", 2) for i in range(5)))
    pol.order(q, in_use(2), always, FCFS)
    assert names(q) == "01234A" and pol._clock == {"A": 1}
    q.pop_request()  # "0" is admitted; A waits behind the rest
    pol.order(q, in_use(2), always, FCFS)
    assert names(q) == "1234A" and pol._clock == {"A": 2}
    pol.order(q, in_use(2), always, FCFS)
    assert names(q) == "A1234"  # aged: at the front, ahead of the preferred ones


def test_a_clock_survives_steps_out_of_the_queue_and_goes_once_the_request_does():
    pol = AdapterAffinity(max_wait_steps=2)
    a = req("A", 1)
    q = queue_of(a, req("B", 2))
    pol.order(q, in_use(2), always, FCFS)
    assert pol._clock == {"A": 1}
    q.remove_requests([a])  # set aside for a step (its adapter went cold): kept, not counted
    pol.order(q, in_use(2), always, FCFS)
    assert pol._clock == {"A": 1}
    q.prepend_request(a)
    q.add_request(req("C", 2))
    pol.order(q, in_use(2), always, FCFS)
    assert names(q) == "BCA" and pol._clock == {"A": 2}
    pol.order(q, in_use(2), always, FCFS)
    assert names(q) == "ABC"
    q.pop_request()  # admitted
    pol.order(q, in_use(2), lambda rid: rid != "A", FCFS)
    assert pol._clock == {}


@pytest.mark.parametrize("seed", range(5))
def test_random_steps_keep_the_invariants(seed):
    """Requests arrive, some are set aside for a step, some are admitted from
    the front. The order is a permutation, in at most three runs each in queue
    order (aged, preferred, the rest), and a request that has waited the bound
    since it was passed over is in the front run. The clock kept here follows
    the module's spec: it starts when a request that is neither aged nor
    preferred has one behind it go ahead, and runs in each later step in which
    the request is in the queue, neither aged nor preferred."""
    import random

    rng = random.Random(seed)
    bound = 3
    pol = AdapterAffinity(max_wait_steps=bound)
    q = queue_of()
    live: set[str] = set()
    clock: dict[str, int] = {}
    n = aged_seen = 0
    for _ in range(300):
        for _ in range(rng.randint(0, 3)):
            q.add_request(req(f"r{n}", rng.choice([None, 1, 2, 3, 4, 5])))
            live.add(f"r{n}")
            n += 1
        aside = [r for r in q if rng.random() < 0.1]
        q.remove_requests(aside)
        pref = in_use(*rng.sample([1, 2, 3, 4, 5], rng.randint(0, 3)))
        before = list(q)
        pol.order(q, pref, live.__contains__, FCFS)
        after = list(q)
        assert sorted(r.request_id for r in after) == sorted(r.request_id for r in before)
        pos = {r.request_id: k for k, r in enumerate(before)}
        order = [pos[r.request_id] for r in after]
        assert sum(order[i] < order[i - 1] for i in range(1, len(order))) <= 2
        aged = {r.request_id for r in before if clock.get(r.request_id, 0) >= bound}
        aged_seen += len(aged)
        assert {r.request_id for r in after[:len(aged)]} == aged  # the front run
        for k, r in enumerate(after):
            rid = r.request_id
            if rid in aged or pref(r):
                continue
            if rid in clock or any(pos[x.request_id] > pos[rid] for x in after[:k]):
                clock[rid] = clock.get(rid, 0) + 1
        for r in aside:
            q.prepend_request(r)
        for _ in range(rng.randint(0, 3)):  # admissions from the front
            if q:
                r = q.pop_request()
                live.discard(r.request_id)
                clock.pop(r.request_id, None)
    assert aged_seen > 0  # the bound was reached, so the check above ran
