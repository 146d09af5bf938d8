"""Per-adapter demand (tokens/s), as LoRAServe's placement step 1 needs it.

Tokens are prompt + output tokens of the requests that arrived in a window.
LoRAServe "extrapolates" each adapter's demand from its history without
saying how; a window holds few requests per adapter (Poisson noise of
1/sqrt(count)), so plain linear extrapolation from the last two windows
doubles that noise. This tracker uses Holt's linear smoothing instead: a
level (weight `alpha` on the new window) and a trend (weight `beta`), the
estimate for the next window being level + trend, never below zero. It
follows drifting demand (shifting skew) with a lag of a few windows.
"""

from __future__ import annotations

from collections import defaultdict


class DemandTracker:
    def __init__(self, window_s: float, alpha: float = 0.5, beta: float = 0.3) -> None:
        if window_s <= 0 or not 0 < alpha <= 1 or not 0 <= beta <= 1:
            raise ValueError("need window_s > 0, 0 < alpha <= 1, 0 <= beta <= 1")
        self.window_s, self.alpha, self.beta = window_s, alpha, beta
        self._current: dict[str, float] = defaultdict(float)
        self._last: dict[str, float] = {}
        self._level: dict[str, float] = {}
        self._trend: dict[str, float] = {}

    def record(self, adapter: str, tokens: int) -> None:
        self._current[adapter] += tokens

    def roll(self, elapsed_s: float | None = None) -> None:
        """Close the current window (call every `window_s`; a window closed
        early or late passes its real length as `elapsed_s`)."""
        window = elapsed_s if elapsed_s and elapsed_s > 0 else self.window_s
        self._last = {a: t / window for a, t in self._current.items()}
        self._current = defaultdict(float)
        for a in set(self._level) | set(self._last):
            x = self._last.get(a, 0.0)
            if a not in self._level:
                self._level[a], self._trend[a] = x, 0.0
                continue
            level = self.alpha * x + (1 - self.alpha) * (self._level[a] + self._trend[a])
            self._trend[a] = (self.beta * (level - self._level[a])
                              + (1 - self.beta) * self._trend[a])
            self._level[a] = level

    def last_window(self) -> dict[str, float]:
        return dict(self._last)

    def estimate(self) -> dict[str, float]:
        return {a: max(0.0, self._level[a] + self._trend[a]) for a in self._level}
