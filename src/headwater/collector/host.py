"""The side of the intake workers' links that runs in the process holding the log.

Each worker has one socket to this process (``wire`` frames) and one thread here that reads it:

- APPEND: the worker's batches, already in the log's columnar format, are queued on the log's
  writer as they are (no event is decoded or copied again here). Answers are collected per group
  commit and sent with one write per worker per round (the writer's ``round_end``).
- CONN_OPEN / CONN_CLOSE: one ``Connections`` count for every worker, so the limits per
  identity and in total hold across them; a worker that goes away releases its connections.
- CALL: a topic's partition count (the worker partitions keyed events), readiness (``up``'s
  destinations), and the merged metrics.
- Metrics: each worker keeps its own counters; on demand this side asks every worker for a
  snapshot (ASK) and sums them, keeping the last snapshot of a worker that went away (counters
  never go backwards; its connection gauge is dropped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector

from headwater.bus.base import Bus
from headwater.bus.embedded.writer import Finish, Parts
from headwater.bus.errors import BusError, BusUnavailable
from headwater.collector import wire
from headwater.collector.errors import Rejected
from headwater.collector.limits import Connections

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 2.0
FRESH_S = 1.0
SEND_TIMEOUT_S = 30.0
READ_BYTES = 128 << 10  # read from a worker's socket at once


class WorkerLink:
    """This side of one worker's socket."""

    def __init__(
        self, host: LogHost, index: int, sock: socket.socket, ring: mmap.mmap | None = None
    ) -> None:
        self.host = host
        self.index = index
        self.sock = sock
        self.ring = memoryview(ring) if ring is not None else None  # the worker's bodies
        sock.settimeout(None)
        # a worker that stops reading must not stall the log's syncer for long (blocking sends
        # give up after this; the worker is then treated as gone)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0)
        )
        self._send_lock = threading.Lock()
        self._outbox: list[bytes] = []
        self._outbox_lock = threading.Lock()
        self.identities: dict[str, int] = {}
        self.snapshot: list[Any] = []
        self._waiting: dict[int, threading.Event] = {}
        self.alive = True
        self.ready = False
        self.thread = threading.Thread(
            target=self._run, name=f"headwater-intake-link-{index}", daemon=True
        )

    # -- sending ----------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as e:
            if self.alive:
                log.warning("intake worker %d: cannot answer it: %s", self.index, e)

    def queue(self, data: bytes) -> None:
        with self._outbox_lock:
            self._outbox.append(data)

    def round_end(self) -> None:
        """Send what this round's appends answered, in one write."""
        with self._outbox_lock:
            out, self._outbox = self._outbox, []
        if out:
            self.send(b"".join(out))

    # -- reading ----------------------------------------------------------------------------
    def _run(self) -> None:
        frames = wire.Frames()
        try:
            while data := self.sock.recv(READ_BYTES):
                appends: list[tuple[int, memoryview]] = []
                for kind, ident, payload in frames.feed(data):
                    if kind == wire.APPEND:
                        appends.append((ident, payload))
                    else:
                        self._handle(kind, ident, payload)
                if appends:  # every APPEND read in one go is queued on the writer together
                    self._append(appends)
        except OSError as e:
            log.info("intake worker %d: link closed: %s", self.index, e)
        except Exception:
            log.exception("intake worker %d: bad frame; link closed", self.index)
        finally:
            self.alive = False
            # the worker must see its link end (and stop, to be started again), whatever ended it
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.host.gone(self)

    def _handle(self, kind: int, ident: int, payload: memoryview) -> None:
        if kind == wire.CONN_OPEN:
            self._open(ident, bytes(payload).decode())
        elif kind == wire.CONN_CLOSE:
            self._close(bytes(payload).decode())
        elif kind == wire.CALL:
            self.host.calls.submit(self._call, ident, json.loads(bytes(payload)))
        elif kind == wire.READY:
            self.ready = True
        elif kind == wire.SNAPSHOT:
            self.snapshot = json.loads(bytes(payload))
            event = self._waiting.pop(ident, None)
            if event is not None:
                event.set()
        else:
            raise ValueError(f"unknown frame kind {kind}")

    def _append(self, frames: list[tuple[int, memoryview]]) -> None:
        """Queue the batches of several APPEND frames at once (each frame all or none: when
        the frames together are refused for one frame's bad topic, each is tried alone)."""
        bus = self.host.bus
        items = []
        for ident, payload in frames:
            batches = wire.read_append(payload, self.ring)
            reply = Parts(len(batches), self._answer(ident), self.round_end)
            items.append((ident, [(t, p, b, reply.part(i)) for i, (t, p, b) in enumerate(batches)]))
        if bus is None or not hasattr(bus, "append_encoded"):
            error = BusUnavailable("this process holds no embedded log to append to")
            for ident, _ in items:
                self._refuse(ident, error)
            return
        try:
            bus.append_encoded([batch for _, batches in items for batch in batches])
        except BusUnavailable as e:
            for ident, _ in items:
                self._refuse(ident, e)
        except BusError as e:
            if len(items) == 1:
                self._refuse(items[0][0], e)
                return
            for ident, batches in items:
                try:
                    bus.append_encoded(batches)
                except (BusUnavailable, BusError) as one:
                    self._refuse(ident, one)

    def _answer(self, ident: int) -> Finish:
        """Queue the answer to APPEND ``ident`` (sent at the end of the writer's round)."""

        def finish(bases: list[int], error: BaseException | None) -> None:
            if error is not None:
                message = getattr(error, "message", str(error))
                payload = wire.error_payload(wire.ERROR_UNAVAILABLE, message)
            else:
                payload = wire.bases_payload(bases)
            self.queue(wire.frame(wire.RESULT, ident, payload))

        return finish

    def _refuse(self, ident: int, e: BusUnavailable | BusError) -> None:
        status = wire.ERROR_UNAVAILABLE if isinstance(e, BusUnavailable) else wire.ERROR_INVALID
        self.send(wire.frame(wire.RESULT, ident, wire.error_payload(status, e.message)))

    def _open(self, ident: int, identity: str) -> None:
        try:
            with self.host.counting:
                self.host.connections.open(identity)
                self.identities[identity] = self.identities.get(identity, 0) + 1
        except Rejected as e:
            self.send(wire.frame(wire.RESULT, ident, wire.refusal_payload(e)))
            return
        self.send(wire.frame(wire.RESULT, ident, bytes((wire.OK,))))

    def _close(self, identity: str) -> None:
        with self.host.counting:
            held = self.identities.get(identity, 0)
            if held <= 0:
                return
            if held == 1:
                del self.identities[identity]
            else:
                self.identities[identity] = held - 1
            self.host.connections.close(identity)

    def _call(self, ident: int, doc: dict[str, Any]) -> None:
        try:
            answer = self.host.call(doc)
        except Exception as e:  # an answer, never a hang: the worker shows it
            log.exception("intake worker %d: call %s failed", self.index, doc.get("op"))
            payload = wire.error_payload(wire.ERROR_FAILED, str(e))
        else:
            payload = bytes((wire.OK,)) + json.dumps(answer).encode()
        self.send(wire.frame(wire.RESULT, ident, payload))

    def ask_snapshot(self, ident: int) -> threading.Event:
        event = threading.Event()
        self._waiting[ident] = event
        self.send(wire.frame(wire.ASK, ident))
        return event


class LogHost:
    """Serves the intake workers' links (see the module)."""

    def __init__(self, bus: Bus | None, connections: Connections) -> None:
        self.bus = bus
        self.connections = connections
        self.links: list[WorkerLink] = []
        self.calls = ThreadPoolExecutor(2, thread_name_prefix="headwater-intake-call")
        self.readiness: Callable[[], dict[str, str]] | None = None
        self.also: list[CollectorRegistry] = []  # served with the workers' metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Merged(self))
        self._lock = threading.Lock()
        # the connection counts: every link's thread opens and closes under it
        self.counting = threading.Lock()
        self._ask = 0
        self._refreshed_at = 0.0
        self.notice: dict[str, Any] = {}
        # the counters of workers that went away (they never go backwards)
        self.retired: list[list[Any]] = []

    def attach(self, index: int, sock: socket.socket, ring: mmap.mmap | None = None) -> WorkerLink:
        link = WorkerLink(self, index, sock, ring)
        with self._lock:
            self.links = [*(x for x in self.links if x.index != index or x.alive), link]
        link.thread.start()
        if self.notice:
            link.send(wire.json_frame(wire.NOTICE, 0, self.notice))
        return link

    def all_ready(self, count: int) -> bool:
        return sum(1 for link in self.links if link.alive and link.ready) >= count

    def gone(self, link: WorkerLink) -> None:
        """A worker's link closed: release the connections it held, keep its counters."""
        with self.counting:
            for identity, held in list(link.identities.items()):
                for _ in range(held):
                    self.connections.close(identity)
            link.identities.clear()
        with self._lock:
            self.retired.append([f for f in link.snapshot if f[1] != "gauge"])
            link.snapshot = []

    def tell(self, notice: dict[str, Any]) -> None:
        """Send every worker a state change (the admission refusal)."""
        self.notice.update(notice)
        for link in self.links:
            if link.alive:
                link.send(wire.json_frame(wire.NOTICE, 0, notice))

    def call(self, doc: dict[str, Any]) -> Any:
        op = doc.get("op")
        if op == "topic":
            if self.bus is None or not hasattr(self.bus, "partitions_for_append"):
                raise BusUnavailable("this process holds no embedded log")
            return self.bus.partitions_for_append(str(doc["name"]))
        if op == "ready":
            return self.readiness() if self.readiness is not None else {}
        if op == "metrics":
            return self.render().decode()
        raise ValueError(f"unknown call {op!r}")

    # -- metrics ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Ask every live worker for its counters now (each answers within the timeout)."""
        self._refreshed_at = time.monotonic()
        with self._lock:
            self._ask += 1
            ident = self._ask
        waits = [link.ask_snapshot(ident) for link in self.links if link.alive]
        for w in waits:
            w.wait(SNAPSHOT_TIMEOUT_S)

    def render(self) -> bytes:
        self.refresh()
        return b"".join(generate_latest(r) for r in (self.registry, *self.also))

    def merged(self) -> Iterator[Metric]:
        """Every worker's samples summed (asking them first when the last answers are older
        than ``FRESH_S``: the console reads the registry without ``render``)."""
        if time.monotonic() - self._refreshed_at > FRESH_S:
            self.refresh()
        families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]
        families = {}
        with self._lock:
            snapshots = [*self.retired, *(link.snapshot for link in self.links)]
        for snapshot in snapshots:
            for name, kind, doc, samples in snapshot:
                family = families.setdefault(name, (kind, doc, {}))
                for sample, labels, value in samples:
                    key = (sample, tuple(sorted(labels.items())))
                    if sample.endswith("_created"):
                        family[2][key] = min(family[2].get(key, value), value)
                    else:
                        family[2][key] = family[2].get(key, 0.0) + value
        for name, (kind, doc, samples) in families.items():
            metric = Metric(name, doc, kind)
            for (sample, labels), value in samples.items():
                metric.add_sample(sample, dict(labels), value)
            yield metric

    def close(self) -> None:
        for link in self.links:
            link.alive = False
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
        for link in self.links:
            link.thread.join(5)
            link.sock.close()
        self.calls.shutdown(wait=False, cancel_futures=True)


class _Merged(PromCollector):
    def __init__(self, host: LogHost) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        return self.host.merged()
