"""A counting doorbell between processes: a Linux eventfd in semaphore mode.

The engine rings a worker's bell once per job (a batch's rings in one
write) and each worker rings the engine's when a job it was told to report
is done; a waiter sleeps in the kernel until a ring or its timeout. An
eventfd is a file descriptor, handed to the workers with `pass_fds`, so it
needs no multiprocessing (which refuses to start children from vLLM's
daemonic worker processes) and carries no data: rows and jobs go through
shared memory (control.py).
"""

from __future__ import annotations

import os
import select


class Doorbell:
    def __init__(self, fd: int | None = None) -> None:
        """A new bell, or (in a worker) the inherited descriptor `fd`."""
        flags = os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self.fd = os.eventfd(0, flags) if fd is None else fd

    def ring(self, times: int = 1) -> None:
        """`times` rings at once (one write: a waiter takes them one by one)."""
        os.eventfd_write(self.fd, times)

    def wait(self, timeout: float) -> bool:
        """Take one ring, waiting up to `timeout` seconds; False if none came."""
        if self.take():
            return True
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return bool(ready) and self.take()

    def take(self) -> bool:
        """Take one ring if there is one, without waiting."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
