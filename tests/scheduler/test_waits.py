"""An adapter wait ends when the adapter is ready, not at admission: time in
the queue after that (for KV blocks) is vLLM's queue time."""

from __future__ import annotations

import pytest

from vllm_loraserve.scheduler.waits import AdapterWaits


def test_the_wait_ends_when_the_adapter_is_ready():
    w = AdapterWaits()
    w.held("a", 10.0)
    w.held("a", 11.0)  # held again the next step: the wait started at 10
    w.ready("a", 12.5)
    w.ready("a", 13.0)  # still ready: nothing more
    assert w.admitted("a", 40.0) == pytest.approx(2.5)  # 27.5 s in the KV queue are not counted
    assert w.admitted("a", 41.0) == 0.0  # re-admitted after a preemption: waited no more


def test_a_request_never_held_waited_nothing_and_admission_ends_a_wait():
    w = AdapterWaits()
    assert w.admitted("b", 5.0) == 0.0
    w.held("c", 1.0)
    assert w.admitted("c", 3.0) == pytest.approx(2.0)  # ready and admitted in one step


def test_waits_add_up_when_the_adapter_goes_cold_again():
    w = AdapterWaits()
    w.held("a", 0.0)
    w.ready("a", 1.0)
    w.held("a", 5.0)  # evicted from the host tier before admission
    w.ready("a", 7.0)
    assert w.admitted("a", 9.0) == pytest.approx(3.0)


def test_a_finished_request_is_forgotten():
    w = AdapterWaits()
    w.held("a", 0.0)
    w.forget("a")
    assert w.admitted("a", 9.0) == 0.0
