"""Requests set aside for a step go back to vLLM's waiting queue in their order."""

from __future__ import annotations

from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from vllm_loraserve.scheduler.scheduler import take_out


class Req:
    def __init__(self, name: str, arrival: float) -> None:
        self.request_id, self.priority, self.arrival_time = name, 0, arrival

    def __lt__(self, other: Req) -> bool:
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)


def test_fcfs_order_survives_many_steps():
    reqs = [Req(n, t) for t, n in enumerate("ABCDE")]
    queue = create_request_queue(SchedulingPolicy.FCFS)
    for r in reqs:
        queue.add_request(r)
    for _ in range(3):  # the same requests set aside step after step
        aside = take_out(queue, [reqs[0], reqs[2], reqs[3]], SchedulingPolicy.FCFS)
        assert [r.request_id for r in queue] == ["B", "E"]
        queue.prepend_requests(aside)
        assert [r.request_id for r in queue] == ["A", "C", "D", "B", "E"]
        queue.remove_requests([reqs[1], reqs[4]])  # B and E were admitted; back they come
        for r in (reqs[1], reqs[4]):
            queue.add_request(r)


def test_priority_queue_keeps_its_order():
    reqs = [Req(n, t) for t, n in enumerate("ABCD")]
    queue = create_request_queue(SchedulingPolicy.PRIORITY)
    for r in reqs:
        queue.add_request(r)
    queue.prepend_requests(take_out(queue, [reqs[1], reqs[3]], SchedulingPolicy.PRIORITY))
    assert [queue.pop_request().request_id for _ in range(4)] == ["A", "B", "C", "D"]
