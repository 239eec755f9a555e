"""The pieces every cost-driven controller here shares: a sliding window of measured costs
with a prediction that reacts to a slowdown at once but not to one fast sample, and a hold that
keeps a decision for a number of ticks after it changed (hysteresis). The nightly tier
scheduler (``jobs.farm.scheduler``: seconds per step per group) and the streaming preview's
frame-time scheduler (``pipeline.adaptive``: seconds per step per frame) are built on them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from statistics import median


class CostWindow:
    """The last ``size`` measured costs."""

    def __init__(self, size: int = 10):
        if size < 1:
            raise ValueError(f"size={size}: a window holds at least 1 sample")
        self._d: deque[float] = deque(maxlen=size)

    def add(self, cost: float) -> None:
        if not cost > 0:
            raise ValueError(f"cost={cost}: a measured cost must be positive")
        self._d.append(float(cost))

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()

    def mean(self) -> float | None:
        return sum(self._d) / len(self._d) if self._d else None

    def predict(self) -> float | None:
        """The next cost: the larger of the window's median and the mean of its last three, so a
        slowdown counts at once and a single fast sample does not."""
        if not self._d:
            return None
        last = list(self._d)[-3:]
        return max(median(self._d), sum(last) / len(last))


@dataclass
class Hold:
    """Ticks since the last change; a change is allowed once ``ticks`` have passed."""

    ticks: int
    since: int = 1 << 30  # nothing changed yet: free to change

    def tick(self) -> None:
        self.since += 1

    def changed(self) -> None:
        self.since = 0

    @property
    def ready(self) -> bool:
        return self.since >= self.ticks

    @property
    def left(self) -> int:
        return max(0, self.ticks - self.since)


class Pacer:
    """Hands out items no sooner than ``interval`` seconds apart: a call that finished several
    frames at once does not deliver them in a burst, and a late one is not caught up on. The
    preview's frames go out at its frame-time budget this way (the review server, a farm worker,
    the bench)."""

    def __init__(self, interval: float):
        self.interval = interval
        self.t_next = time.perf_counter()

    def delay(self) -> float:
        """Seconds to wait before the next item goes out (and count it as gone then)."""
        self.t_next = max(self.t_next + self.interval, time.perf_counter())
        return max(0.0, self.t_next - time.perf_counter())

    def wait(self) -> None:
        time.sleep(self.delay())
