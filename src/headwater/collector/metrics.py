"""The collector's metrics: Prometheus (served on /metrics) and, optionally, StatsD.

Counters are bumped once per request and type, never per event: ``type_counts`` tallies a
request's events by type once, and both ``received`` and ``published`` count from that tally.
Event types are the clients' words, so the ``type`` label holds at most ``MAX_TYPES`` distinct
values; later ones count as ``other``. The labelled children are looked up once per label and
kept (prometheus_client's ``labels()`` costs more than the increment).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from headwater.collector.config import StatsdConfig
from headwater.collector.events import EventIn, event_type, event_value

log = logging.getLogger(__name__)

MAX_TYPES = 1000
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

TypeCounts = dict[str, tuple[int, int]]
"""Event type -> (events, value bytes) of a request's events."""


def type_counts(events: Sequence[EventIn]) -> TypeCounts:
    """``events`` tallied by type. A request's events mostly share one type: then the tally is
    two C-level passes, with no Python work per event."""
    if not events:
        return {}
    types = list(map(event_type, events))
    first = types[0]
    if types.count(first) == len(types):
        return {first: (len(types), sum(map(len, map(event_value, events))))}
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for t, value in zip(types, map(event_value, events), strict=True):
        counts[t] = counts.get(t, 0) + 1
        sizes[t] = sizes.get(t, 0) + len(value)
    return {t: (n, sizes[t]) for t, n in counts.items()}


class _Children(dict[Any, Any]):
    """Labelled children kept by their labels: ``make(key)`` makes a missing one."""

    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: Any) -> Any:
        child = self[key] = self._make(key)
        return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "headwater_collector_"
        self.events_received = Counter(
            p + "events_received", "Events decoded", ["type", "protocol"], registry=r
        )
        self.source_events = Counter(
            p + "source_events", "Events decoded per source", ["source", "protocol"], registry=r
        )
        self.bytes_received = Counter(
            p + "bytes_received", "Event bytes decoded", ["type"], registry=r
        )
        self.events_published = Counter(
            p + "events_published", "Events durable on the log", ["type"], registry=r
        )
        self.bytes_published = Counter(
            p + "bytes_published", "Event bytes durable on the log", ["type"], registry=r
        )
        self.ack_latency = Histogram(
            p + "ack_latency_seconds",
            "Time from receiving a request to acknowledging it",
            ["protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.connections = Gauge(p + "connections", "Open WebSocket connections", registry=r)
        self.rejects = Counter(p + "rejects", "Requests refused", ["reason"], registry=r)
        self.lost = Counter(
            p + "lost_after_ack",
            "Batches acked on receipt (ack: received) that the log did not store",
            registry=r,
        )
        self.grpc_shared = Counter(
            p + "grpc_calls_shared",
            "gRPC calls this intake worker handed to its sibling (handed), served for it "
            "(taken), or had declined by it and served itself (declined)",
            ["way"],
            registry=r,
        )
        self.shared = _Children(self.grpc_shared.labels)
        self._types: set[str] = set()
        # labelled children, by their labels (bounded as the labels are)
        self._received = _Children(
            lambda k: (self.events_received.labels(*k), self.bytes_received.labels(k[0]))
        )
        self._published = _Children(
            lambda label: (self.events_published.labels(label), self.bytes_published.labels(label))
        )
        self._sources = _Children(lambda k: self.source_events.labels(k[0] or "anonymous", k[1]))
        self._latency = _Children(self.ack_latency.labels)
        self.also: list[CollectorRegistry] = []  # served too: what else runs in the process

    def _label(self, event_type: str) -> str:
        if event_type in self._types:
            return event_type
        if len(self._types) < MAX_TYPES:
            self._types.add(event_type)
            return event_type
        return "other"

    def received(self, counts: TypeCounts, protocol: str) -> None:
        for t, (n, size) in counts.items():
            events, nbytes = self._received[self._label(t), protocol]
            events.inc(n)
            nbytes.inc(size)

    def from_source(self, source: str, protocol: str, events: int) -> None:
        """Sources are configured (write keys name them), so the label stays small."""
        self._sources[source, protocol].inc(events)

    def published(self, counts: TypeCounts) -> None:
        for t, (n, size) in counts.items():
            events, nbytes = self._published[self._label(t)]
            events.inc(n)
            nbytes.inc(size)

    def acked(self, protocol: str, seconds: float) -> None:
        """A request's time from receipt to its ack."""
        self._latency[protocol].observe(seconds)

    def rejected(self, reason: str) -> None:
        self.rejects.labels(reason).inc()

    def lost_after_ack(self) -> None:
        self.lost.inc()

    def render(self) -> bytes:
        return b"".join(generate_latest(r) for r in (self.registry, *self.also))

    def snapshot(self) -> list[Any]:
        """The samples as JSON-able lists (what an intake worker sends the process that
        holds the log, which sums every worker's)."""
        return [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in self.registry.collect()
        ]


class StatsdExporter:
    """Sends the counters' increments and the gauges' values over UDP every interval."""

    def __init__(self, metrics: Metrics, config: StatsdConfig) -> None:
        self._metrics = metrics
        self._config = config
        self._last: dict[str, float] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def lines(self) -> list[str]:
        out = []
        for family in self._metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket")):
                    continue
                labels = ".".join(
                    f"{v}".replace(".", "_") for _, v in sorted(sample.labels.items())
                )
                name = f"{self._config.prefix}.{sample.name}" + (f".{labels}" if labels else "")
                if family.type == "gauge":
                    out.append(f"{name}:{sample.value:g}|g")
                    continue
                delta = sample.value - self._last.get(name, 0.0)
                self._last[name] = sample.value
                if delta:
                    out.append(f"{name}:{delta:g}|c")
        return out

    async def run(self) -> None:
        address = (self._config.host, self._config.port)
        while True:
            await asyncio.sleep(self._config.interval_s)
            self.flush(address)

    def flush(self, address: tuple[str, int]) -> None:
        for line in self.lines():
            try:
                self._sock.sendto(line.encode(), address)
            except OSError as e:  # metrics never take the collector down
                log.debug("statsd send failed: %s", e)
                return

    def close(self) -> None:
        self._sock.close()
