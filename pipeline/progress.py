"""When a long loop prints a progress line: every `every` items, at the last one, and never more than
`MAX_SILENCE_S` seconds after the line before (the warm start, the update, its log-prob passes)."""

from __future__ import annotations

import time

MAX_SILENCE_S = 30.0


class Ticker:
    def __init__(self, total: int | None = None, every: int | None = None):
        self.total, self.every = total, every
        self.started = self.last = time.perf_counter()

    def due(self, done: int) -> bool:
        """Whether a line is due after `done` items; if so, the clock restarts for the next silence."""
        now = time.perf_counter()
        if (done == self.total or (self.every is not None and done % self.every == 0)
                or now - self.last >= MAX_SILENCE_S):
            self.last = now
            return True
        return False

    def rate(self, done: int) -> float:
        """Items per second up to the last line."""
        return done / (self.last - self.started)

    def pace(self, done: int, unit: str = "step") -> str:
        """The rate for a progress line: "2.31 steps/s", or "33.2 s/step" when an item takes over a second."""
        rate = self.rate(done)
        return f"{rate:.2f} {unit}s/s" if rate >= 1 else f"{1 / rate:.1f} s/{unit}"
