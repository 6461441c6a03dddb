"""The overview's time series: points of the last hour, kept in this process's memory.

A sampler takes a point every ``console.sample_interval_s``: the collector's counters (events
by protocol and by source: from the collector in this process, or read from a collector's
``/metrics``), the records on each topic of the log, each writer's lag and the failed store's
size. Counters become rates between two points.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping

HOUR_S = 3600.0


class Series:
    """Named lines of (time, value) points, each kept for ``keep_s`` seconds."""

    def __init__(self, keep_s: float = HOUR_S) -> None:
        self.keep_s = keep_s
        self._lines: dict[str, deque[tuple[float, float]]] = {}

    def add(self, values: Mapping[str, float], at: float | None = None) -> None:
        at = time.time() if at is None else at
        for name, value in values.items():
            line = self._lines.setdefault(name, deque())
            line.append((at, float(value)))
            while line and line[0][0] < at - self.keep_s:
                line.popleft()

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self._lines if n.startswith(prefix))

    def points(self, name: str) -> list[tuple[float, float]]:
        return list(self._lines.get(name, ()))

    def rates(self, name: str) -> list[tuple[float, float]]:
        """Per-second increase between consecutive points of a counter (a restart of the
        counted process, where it goes down, counts from zero)."""
        pts = self.points(name)
        out = []
        for (t0, v0), (t1, v1) in itertools.pairwise(pts):
            if t1 > t0:
                out.append((t1, max(0.0, v1 - v0 if v1 >= v0 else v1) / (t1 - t0)))
        return out
