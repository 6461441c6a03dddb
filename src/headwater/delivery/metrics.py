"""Metrics of the ``http`` destinations, per destination, in the process that runs the pipeline
(``headwater up`` serves them on ``/metrics`` beside the collector's).

The requests are sent by Spark tasks, in Python workers of their own: each task tallies what it
sent (``Tally``) and returns it with its commit message; the driver adds a batch's tallies here
once the batch is committed (a replayed batch is not counted twice). So the figures move per
micro-batch, and ``headwater_delivery_sessions`` is the sessions of the last batch, not a live
count.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Tally:
    """What one task sent: requests, retries, events, bytes and each request's latency."""

    requests: int = 0
    retries: int = 0
    delivered: int = 0
    failed: int = 0
    bytes: int = 0
    sessions: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Tally:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class _Latency(Collector):
    """Request latency per destination, from the tasks' bucket counts."""

    def __init__(self) -> None:
        self.buckets: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def add(self, destination: str, tally: Tally) -> None:
        mine = self.buckets.setdefault(destination, [0] * (len(LATENCY_BUCKETS) + 1))
        for i, n in enumerate(tally.buckets):
            mine[i] += n
        self.sums[destination] = self.sums.get(destination, 0.0) + tally.latency_sum

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "headwater_delivery_request_seconds",
            "Time from sending a request to its answer",
            labels=["destination"],
        )
        for destination, counts in sorted(self.buckets.items()):
            cumulative, running = [], 0
            for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts, strict=True):
                running += n
                cumulative.append((bound, running))
            family.add_metric([destination], cumulative, self.sums[destination])
        yield family


class DeliveryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p, d = self.registry, "headwater_delivery_", ["destination"]
        self.requests = Counter(p + "requests", "Requests sent (retries included)", d, registry=r)
        self.retries = Counter(p + "retries", "Requests sent again after a failure", d, registry=r)
        self.events = Counter(p + "events", "Events delivered", d, registry=r)
        self.failed = Counter(p + "failed_events", "Events given up (failed store)", d, registry=r)
        self.bytes = Counter(p + "bytes", "Request body bytes sent (as sent)", d, registry=r)
        self.sessions = Gauge(p + "sessions", "Sessions of the last micro-batch", d, registry=r)
        self.latency = _Latency()
        r.register(self.latency)

    def add(self, destination: str, tallies: list[Tally]) -> None:
        """A committed batch's tallies, one per task."""
        for t in tallies:
            self.requests.labels(destination).inc(t.requests)
            self.retries.labels(destination).inc(t.retries)
            self.events.labels(destination).inc(t.delivered)
            self.failed.labels(destination).inc(t.failed)
            self.bytes.labels(destination).inc(t.bytes)
            self.latency.add(destination, t)
        self.sessions.labels(destination).set(sum(t.sessions for t in tallies))


METRICS = DeliveryMetrics()  # the process's (the driver's)
