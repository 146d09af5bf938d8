"""The opt-in step trace (LORASERVE_STEP_TRACE): one line per step, idle ones
too, with the step's own loads, evictions, adapters and bytes (differences
of the pool's running totals) and the time since the previous step."""

from __future__ import annotations

import gc
import json
import time

import torch

from vllm_loraserve.paging.step import STEP_ATTR
from vllm_loraserve.worker import hooks
from vllm_loraserve.worker.step_trace import ENV, StepTrace


class Manager:
    """What _run_step asks of the pool's manager; each forward adds a load,
    two adapters and 100 bytes to the running totals."""

    def __init__(self, trace):
        self.step_trace, self.totals = trace, [0, 0, 0, 0]
        self.read_gate, self.apply_cpu = None, 0.0

    def apply_step(self, step, idle=False):
        time.sleep(0.02)  # page decisions that wait (no CPU time)
        _spin(self.apply_cpu)

    def end_forward(self):
        pass

    def trace_counts(self):
        return tuple(self.totals)

    def report(self):
        return None


class SchedulerOutput:
    def __init__(self, tokens):
        self.total_num_scheduled_tokens = tokens
        setattr(self, STEP_ATTR, None)


def test_each_step_is_a_line_with_its_own_counts(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    trace = StepTrace.from_env()
    manager = Manager(trace)

    def forward():
        manager.totals = [manager.totals[0] + 1, 0, manager.totals[2] + 2,
                          manager.totals[3] + 100]
        return None

    try:
        for tokens in (64, 0, 1):  # an idle step (no tokens) applies loads too: a line
            hooks._run_step(manager, SchedulerOutput(tokens), forward)
    finally:
        trace.close()
    lines = [json.loads(line) for line in open(trace.path)]
    assert [r["tokens"] for r in lines] == [64, 0, 1]
    assert lines[0]["period_s"] is None and all(r["period_s"] > 0 for r in lines[1:])
    # Each line holds its own step's counts, not the running totals.
    assert [(r["loads"], r["adapters"], r["adapter_bytes"]) for r in lines] == [(1, 2, 100)] * 3
    assert all(r["host_s"] >= 0 for r in lines)
    assert abs(lines[1]["mono"] - lines[0]["mono"] - lines[1]["period_s"]) < 2e-6
    # The page decisions' share of the host time, and the thread's CPU time
    # in it: the 20 ms wait in apply_step is host time, not CPU time.
    assert all(0.02 <= r["apply_s"] <= r["host_s"] for r in lines)
    assert all(0 <= r["cpu_s"] <= r["host_s"] - 0.015 for r in lines)
    assert all(0 <= r["apply_cpu_s"] <= r["cpu_s"] for r in lines)
    # The gap runs from the previous step's end to this one's start.
    assert lines[0]["gap_s"] is None
    for prev, r in zip(lines, lines[1:], strict=False):
        assert abs(r["gap_s"] - (r["period_s"] - prev["host_s"])) < 2e-6
    assert lines[0]["gap_cpu_s"] is None


def _spin(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_cpu_outside_the_step_and_of_other_threads(tmp_path, monkeypatch):
    """`gap_cpu_s` is the engine thread's CPU between two steps;
    `threads_cpu_s` the other threads' CPU, by name less its number, and
    `proc_cpu_s` the whole process's since the previous line."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    trace = StepTrace.from_env()
    manager = Manager(trace)
    with ThreadPoolExecutor(2, thread_name_prefix="loraserve-read") as pool:
        try:
            manager.apply_cpu = 0.03  # the page decisions' own CPU time
            hooks._run_step(manager, SchedulerOutput(8), lambda: _spin(0.05))
            manager.apply_cpu = 0.0
            _spin(0.06)  # the engine thread's work between steps
            hooks._run_step(manager, SchedulerOutput(8), lambda: None)
            # Two readers burn CPU (each waits for the other: both run at once)
            # while the engine thread sleeps between steps.
            barrier = threading.Barrier(2)
            list(pool.map(lambda _: (barrier.wait(), _spin(0.05)), range(2)))
            hooks._run_step(manager, SchedulerOutput(8), lambda: None)
        finally:
            trace.close()
    lines = [json.loads(line) for line in open(trace.path)]
    assert 0.03 <= lines[0]["apply_cpu_s"] <= lines[0]["cpu_s"] - 0.05  # not the forward's
    assert lines[1]["apply_cpu_s"] < 0.01
    assert 0.06 <= lines[1]["gap_cpu_s"] <= lines[1]["gap_s"]
    assert lines[2]["gap_cpu_s"] < 0.04  # it waited for the readers, without CPU
    readers = lines[2]["threads_cpu_s"]
    assert set(readers) >= {"loraserve-read"} and readers["loraserve-read"] >= 0.1
    assert "loraserve-read" not in lines[1]["threads_cpu_s"]
    assert lines[2]["proc_cpu_s"] >= readers["loraserve-read"]
    assert lines[1]["proc_cpu_s"] >= 0.06


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert StepTrace.from_env() is None


def test_garbage_collections_and_device_allocations_are_the_steps_own(tmp_path, monkeypatch):
    """A collection in a step's span (since the previous line) is on its
    line alone; the allocator's counts are differences, None without CUDA."""
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    gc.collect()
    gc.disable()  # no automatic collection: the counts are exact
    trace = StepTrace.from_env()
    try:
        manager = Manager(trace)
        for want in (False, True, False):
            def forward(want=want):
                if want:
                    gc.collect()

            hooks._run_step(manager, SchedulerOutput(8), forward)
    finally:
        gc.enable()
        trace.close()
    lines = [json.loads(line) for line in open(trace.path)]
    assert [r["gc_full"] for r in lines] == [0, 1, 0]
    assert lines[1]["gc_s"] > 0 and lines[0]["gc_s"] == lines[2]["gc_s"] == 0
    # This CPU test process never initialised CUDA.
    assert all(r[k] is None for r in lines
               for k in ("device_allocs", "device_frees", "alloc_retries"))

    totals = iter([(5, 1, 0), (9, 4, 2)])
    monkeypatch.setattr(StepTrace, "_allocator", staticmethod(lambda: next(totals)))
    with_cuda = StepTrace(str(tmp_path / "cuda"))
    try:
        for _ in range(2):
            with_cuda.record(0.0, 0.0, 0.0, (0.0, 0.0, 0.0), 1, (0, 0, 0, 0))
    finally:
        with_cuda.close()
    lines = [json.loads(line) for line in open(with_cuda.path)]
    assert [(r["device_allocs"], r["device_frees"], r["alloc_retries"]) for r in lines] == [
        (5, 1, 0), (4, 3, 2)]


def test_allocator_counters_are_read_by_name(monkeypatch):
    """The fields come from the allocator's named counters; a torch without
    one leaves them empty rather than reading a wrong one."""
    stats = {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1,
             "num_ooms": 9, "allocation": {}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda: stats)
    assert StepTrace._allocator() == (7, 3, 1)
    del stats["num_device_free"]
    assert StepTrace._allocator() is None
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda: {})
    assert StepTrace._allocator() is None


def test_a_thread_id_taken_by_a_new_thread_counts_from_zero():
    """Kernel thread ids are reused: a new thread under an ended one's id
    (another name) counts its own CPU time, not the difference."""
    from vllm_loraserve.worker.step_trace import _threads_since

    last = {7: ("loraserve-read", 2.0), 8: ("part", 1.0)}
    now = {7: ("other", 0.5), 8: ("part", 1.25)}
    assert _threads_since(now, last) == {"other": 0.5, "part": 0.25}
