"""Per-adapter demand (tokens/s), as LoRAServe's placement step 1 needs it.

Tokens are prompt + output tokens of requests that arrived in a window. The
estimate for the next window extrapolates linearly from the last two:
last + (last - previous), never below zero.
"""

from __future__ import annotations

from collections import defaultdict


class DemandTracker:
    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._current: dict[str, float] = defaultdict(float)
        self._last: dict[str, float] = {}
        self._previous: dict[str, float] = {}

    def record(self, adapter: str, tokens: int) -> None:
        self._current[adapter] += tokens

    def roll(self) -> None:
        """Close the current window (call every `window_s`)."""
        self._previous = self._last
        self._last = {a: t / self.window_s for a, t in self._current.items()}
        self._current = defaultdict(float)

    def last_window(self) -> dict[str, float]:
        return dict(self._last)

    def estimate(self) -> dict[str, float]:
        names = set(self._last) | set(self._previous)
        return {a: max(0.0, 2 * self._last.get(a, 0.0) - self._previous.get(a, 0.0))
                for a in names}
