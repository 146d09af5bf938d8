"""Moving requests within vLLM's request queues (FCFS deque or priority heap)."""

from __future__ import annotations

from typing import Any


def take_out(queue: Any, requests: list[Any], policy: Any) -> Any:
    """Remove `requests` (in queue order) from a vLLM request queue; returns
    them as a queue that `queue.prepend_requests` puts back in that order
    (it takes its argument back to front, as vLLM's own skipped queue is
    built)."""
    from vllm.v1.core.sched.request_queue import create_request_queue

    queue.remove_requests(requests)
    aside = create_request_queue(policy)
    for request in requests:
        aside.prepend_request(request)
    return aside
