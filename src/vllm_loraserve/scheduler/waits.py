"""How long each admitted request waited for its adapter to be ready.

A request is *held* while its adapter is neither resident nor in the
workers' host tier (the scheduler sets it aside each step). Its wait is the
time from the step that first held it to the step that found its adapter
ready, summed if the adapter went cold again (evicted from the tier) before
admission. Time spent in the queue after that, e.g. for KV blocks, is not
an adapter wait: vLLM reports it as queue time. (Before session 22 the wait
ran until admission: at 1000-2000 adapters its p99 of 21-28 s was mostly the
KV queue, docs/benchmarks/e2e.md.)

Invariant: `admitted` yields one sample per admission, 0 for a request
never held, and forgets the request's wait.
"""

from __future__ import annotations


class AdapterWaits:
    def __init__(self) -> None:
        self._held_since: dict[str, float] = {}  # request id -> held since
        self._waited: dict[str, float] = {}  # request id -> waits ended so far

    def held(self, request_id: str, now: float) -> None:
        """The request's adapter is not ready this step."""
        self._held_since.setdefault(request_id, now)

    def ready(self, request_id: str, now: float) -> None:
        """The request's adapter is ready this step (no-op if it was not held)."""
        since = self._held_since.pop(request_id, None)
        if since is not None:
            self._waited[request_id] = self._waited.get(request_id, 0.0) + now - since

    def admitted(self, request_id: str, now: float) -> float:
        """The request got its adapter's pages and KV: its wait, in seconds."""
        self.ready(request_id, now)
        return self._waited.pop(request_id, 0.0)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self._held_since.pop(request_id, None)
        self._waited.pop(request_id, None)
