"""Where a pipelined page load's layer groups are written.

A lane takes each group's work (copy the group's bytes, pack, write its
pages), then `close(group)`, which signals the group's flag
(worker/group_flags.py) after that work. Two lanes, one contract:

- `StreamLane` (CUDA): the work is queued at once on a side stream, which
  first waits for the main stream as it stands (`start`: whatever read the
  pages before, as KV or as another adapter, and the slot table rows). From
  then on the side stream never waits for the main stream, so a forward
  pass spinning on a flag cannot block the side stream that sets it.
  `landed(g)` asks an event, without waiting. `drain` makes the main stream
  wait for everything queued (the next step's start).
- `HostLane` (CPU: no streams): the work is queued and run in order when
  it is needed: `run_until(g)` (a layer of group g is about to read its
  pages) runs the work of groups <= g, `after_forward` (the forward pass
  is over) and `drain` the rest. Results equal the stream lane's; a layer
  that skipped its wait would read unwritten pages.

A group's work that raises calls its `on_error` (the load fails alone); the
lane goes on, and still signals the group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from vllm_loraserve.worker.group_flags import GroupFlags

Work = Callable[[], None]
OnError = Callable[[Exception], None]


def _run(work: Work, on_error: OnError) -> None:
    try:
        work()
    except Exception as e:  # one load's failure, not the lane's
        on_error(e)


class StreamLane:
    def __init__(self, stream: torch.cuda.Stream, flags: GroupFlags) -> None:
        self.stream, self.flags = stream, flags
        self._closed: dict[int, torch.cuda.Event] = {}

    def start(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        self._closed = {}

    def submit(self, group: int, work: Work, on_error: OnError) -> None:
        try:
            with torch.cuda.stream(self.stream):
                work()
        except Exception as e:  # raised on the host, outside the side stream's context
            on_error(e)

    def close(self, group: int) -> None:
        with torch.cuda.stream(self.stream):
            self.flags.signal(group)
            event = torch.cuda.Event()
            event.record()
        self._closed[group] = event

    def landed(self, group: int) -> bool:
        event = self._closed.get(group)
        return event is None or event.query()

    def run_until(self, group: int) -> None:
        """Nothing to do on the host: the layer's wait is on the device."""

    def after_forward(self) -> None:
        """Nothing: the side stream goes on beside what follows the forward
        pass (the sampler must not wait for loads ahead)."""

    def drain(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


class HostLane:
    def __init__(self, flags: GroupFlags) -> None:
        self.flags = flags
        self._queue: deque[tuple[int, Work, OnError | None]] = deque()

    def start(self) -> None:
        """Host work runs in program order: nothing to wait for."""

    def submit(self, group: int, work: Work, on_error: OnError) -> None:
        self._queue.append((group, work, on_error))

    def close(self, group: int) -> None:
        self._queue.append((group, lambda: self.flags.signal(group), None))

    def landed(self, group: int) -> bool:
        return not any(g <= group for g, _, _ in self._queue)

    def run_until(self, group: int) -> None:
        while self._queue and self._queue[0][0] <= group:
            _, work, on_error = self._queue.popleft()
            if on_error is None:
                work()
            else:
                _run(work, on_error)

    def drain(self) -> None:
        while self._queue:
            self.run_until(self._queue[0][0])

    after_forward = drain
