"""Load for the collector's crash test: concurrent clients that send batches of uniquely
identified events and record which batches were acknowledged.

Every event carries its id (``"id"`` at the top of its JSON bytes); the ``Ledger`` remembers the
bytes each event was sent as, the batch it belongs to, and whether that batch's ack arrived
with success. Clients: Raccoon over WebSocket (several requests in flight per connection),
Raccoon over REST (protobuf) and Segment ``/v1/batch``. They run until the collector dies under
them (or ``stop`` is set); a refused request is simply not acked.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from headwater.collector.protocols import raccoon, segment
from headwater.testing.clients import (
    OP_BINARY,
    OP_CLOSE,
    HandshakeFailed,
    RawWebSocket,
    http_exchange,
    raccoon_request,
    raccoon_response,
)
from headwater.testing.load.http1 import request_bytes

WRITE_KEY = "crash-test-key"
RACCOON_TYPES = ("crash", "crash-b")  # topics clickstream-crash-log, clickstream-crash-b-log
WS_IN_FLIGHT = 8  # requests one WebSocket client keeps outstanding
REPLY_TIMEOUT_S = 10.0  # a live collector answers well within this
ROUND_TIMEOUT_S = 30.0  # one round of load, kill included


@dataclass(frozen=True)
class Batch:
    """One request as sent: its id (the Raccoon ``req_guid`` where there is one), the protocol
    it went by, and its events' ids."""

    id: str
    protocol: str
    event_ids: tuple[str, ...]


@dataclass
class Ledger:
    """Everything sent over all rounds, and which batches were acked."""

    rng: random.Random
    events: dict[str, bytes] = field(default_factory=dict)  # event id -> bytes as sent
    batch_of: dict[str, str] = field(default_factory=dict)  # event id -> batch id
    topic_of: dict[str, str] = field(default_factory=dict)  # event id -> the topic it belongs on
    batches: dict[str, Batch] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    unanswered: set[str] = field(default_factory=set)  # sent, no answer (yet)
    anomalies: list[str] = field(default_factory=list)  # what a live collector must not do
    on_ack: Callable[[], None] = lambda: None

    def new_batch(
        self, batch_id: str, protocol: str, bodies: list[dict[str, object]], topics: list[str]
    ) -> Batch:
        """Register a batch of events (each body gets its id as ``"id"``, first)."""
        ids = []
        for i, (body, topic) in enumerate(zip(bodies, topics, strict=True)):
            eid = f"{batch_id}.{i}"
            self.events[eid] = orjson.dumps({"id": eid, **body})
            self.batch_of[eid] = batch_id
            self.topic_of[eid] = topic
            ids.append(eid)
        batch = Batch(batch_id, protocol, tuple(ids))
        self.batches[batch_id] = batch
        self.unanswered.add(batch_id)
        return batch

    def answered(self, batch_id: str, ok: bool) -> None:
        self.unanswered.discard(batch_id)
        if ok:
            self.acked.add(batch_id)
            self.on_ack()

    def pad(self) -> str:
        return "x" * self.rng.randrange(0, 400)


def raccoon_batch(ledger: Ledger, batch_id: str, protocol: str) -> tuple[Batch, bytes]:
    """A Raccoon ``SendEventRequest`` of 1-20 events over one or two types."""
    n = ledger.rng.randint(1, 20)
    types = [ledger.rng.choice(RACCOON_TYPES) for _ in range(n)]
    bodies: list[dict[str, object]] = [{"pad": ledger.pad()} for _ in range(n)]
    topics = [f"clickstream-{t}-log" for t in types]
    batch = ledger.new_batch(batch_id, protocol, bodies, topics)
    pairs = [(t, ledger.events[eid]) for t, eid in zip(types, batch.event_ids, strict=True)]
    return batch, raccoon_request(batch_id, pairs)


def segment_batch(ledger: Ledger, batch_id: str) -> tuple[Batch, bytes]:
    """A Segment ``/v1/batch`` body of 1-20 track events. Each event is sent as compact JSON,
    which is the form the collector stores it in."""
    n = ledger.rng.randint(1, 20)
    bodies: list[dict[str, object]] = [
        {
            "type": "track",
            "event": "Crash Tested",
            "userId": f"user-{ledger.rng.randrange(8)}",
            "properties": {"pad": ledger.pad()},
        }
        for _ in range(n)
    ]
    batch = ledger.new_batch(batch_id, "segment", bodies, ["events-track"] * n)
    body = b'{"batch":[' + b",".join(ledger.events[e] for e in batch.event_ids) + b"]}"
    return batch, body


def post(port: int, path: str, content_type: str, body: bytes, extra: str = "") -> bytes:
    """A one-shot ``POST`` (``Connection: close``) to the collector at ``port``."""
    return request_bytes(f"127.0.0.1:{port}", "POST", path, body, content_type, extra, close=True)


class Load:
    """One round of load against the collector at ``port``. ``kill`` is called (once) after
    ``kill_after_acks`` acks this round, or ``kill_within_s`` at the latest, plus a random
    jitter of up to 30 ms; it ends the round (the clients stop sending)."""

    def __init__(
        self,
        ledger: Ledger,
        port: int,
        round_no: int,
        kill: Callable[[], None],
        kill_after_acks: int,
        kill_within_s: float | None = None,
    ) -> None:
        self.ledger = ledger
        self.port = port
        self.round = round_no
        self._kill = kill
        self._kill_after = kill_after_acks
        self._kill_within = kill_within_s
        self._acks = 0
        self._killing = False
        self.stop = asyncio.Event()
        self.in_flight_at_kill = 0

    def _counted(self) -> None:
        self._acks += 1
        if self._acks >= self._kill_after:
            self._schedule_kill()

    def _schedule_kill(self) -> None:
        if not self._killing:
            self._killing = True
            jitter = self.ledger.rng.uniform(0.0, 0.03)
            asyncio.get_running_loop().call_later(jitter, self._do_kill)

    def _do_kill(self) -> None:
        self.in_flight_at_kill = len(self.ledger.unanswered)
        self._kill()
        self.stop.set()

    def _anomaly(self, what: str) -> None:
        if not self.stop.is_set():
            self.ledger.anomalies.append(f"round {self.round}: {what}")

    async def run(self, ws_clients: int, rest_clients: int, segment_clients: int) -> None:
        self.ledger.on_ack = self._counted
        self.ledger.unanswered.clear()  # earlier rounds' unanswered batches stay so
        clients = [
            *(self._ws_client(i) for i in range(ws_clients)),
            *(self._rest_client(i) for i in range(rest_clients)),
            *(self._segment_client(i) for i in range(segment_clients)),
        ]
        if self._kill_after == 0:
            self._schedule_kill()
        timer = None
        if self._kill_within is not None:
            timer = asyncio.get_running_loop().call_later(self._kill_within, self._schedule_kill)
        try:
            async with asyncio.timeout(ROUND_TIMEOUT_S):
                await asyncio.gather(*clients)
        finally:
            if timer is not None:
                timer.cancel()
            self.ledger.on_ack = lambda: None

    async def _ws_client(self, k: int) -> None:
        try:
            ws = await RawWebSocket.connect(
                "127.0.0.1", self.port, headers={"X-User-ID": f"crash-{self.round}-{k}"}
            )
        except (OSError, HandshakeFailed) as e:
            self._anomaly(f"WebSocket client {k} could not connect: {e}")
            return
        slots = asyncio.Semaphore(WS_IN_FLIGHT)
        sender = asyncio.create_task(self._ws_send(ws, k, slots))
        receiver = asyncio.create_task(self._ws_receive(ws, k, slots))
        try:
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if sender in done and not sender.result():
                await receiver  # the connection died: acks already received are still read
        finally:
            for task in (sender, receiver):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await ws.close()

    async def _ws_send(self, ws: RawWebSocket, k: int, slots: asyncio.Semaphore) -> bool:
        """Keep ``WS_IN_FLIGHT`` requests outstanding until ``stop``; True once every one was
        answered after ``stop``, False when the connection died."""
        seq = 0
        while True:
            await slots.acquire()
            if self.stop.is_set():
                slots.release()
                break
            _, data = raccoon_batch(self.ledger, f"r{self.round}-ws{k}-{seq}", "ws")
            seq += 1
            ws.send_frame(OP_BINARY, data)
            try:
                await ws.drain()
            except ConnectionError:
                return False
        for _ in range(WS_IN_FLIGHT):
            await slots.acquire()
        return True

    async def _ws_receive(self, ws: RawWebSocket, k: int, slots: asyncio.Semaphore) -> None:
        """Read answers until the connection ends, recording each batch's outcome."""
        while True:
            try:
                frame = await ws.recv_data(REPLY_TIMEOUT_S)
            except TimeoutError:
                self._anomaly(f"WebSocket client {k}: no answer in {REPLY_TIMEOUT_S} s")
                return
            if frame is None or frame.opcode == OP_CLOSE:
                self._anomaly(f"WebSocket client {k}: connection ended")
                return
            resp = raccoon_response(frame.payload)
            guid = resp.data["req_guid"]
            ok = resp.status == raccoon.Status.SUCCESS
            if not ok:
                self._anomaly(f"WebSocket batch {guid} refused: {resp.reason}")
            self.ledger.answered(guid, ok)
            slots.release()

    async def _rest_client(self, k: int) -> None:
        seq = 0
        while not self.stop.is_set():
            batch, data = raccoon_batch(self.ledger, f"r{self.round}-rest{k}-{seq}", "rest")
            seq += 1
            request = post(self.port, "/api/v1/events", "application/proto", data)
            if not await self._exchange(batch, request, raccoon_ok):
                return

    async def _segment_client(self, k: int) -> None:
        auth = base64.b64encode(f"{WRITE_KEY}:".encode()).decode()
        seq = 0
        while not self.stop.is_set():
            batch, body = segment_batch(self.ledger, f"r{self.round}-seg{k}-{seq}")
            seq += 1
            request = post(
                self.port, "/v1/batch", "application/json", body, f"Authorization: Basic {auth}\r\n"
            )
            if not await self._exchange(batch, request, segment_ok):
                return

    async def _exchange(
        self, batch: Batch, request: bytes, ok: Callable[[int, bytes], bool]
    ) -> bool:
        """Send one request; False once the collector is gone."""
        try:
            resp = await http_exchange("127.0.0.1", self.port, request, REPLY_TIMEOUT_S)
        except OSError as e:
            self._anomaly(f"{batch.protocol} batch {batch.id}: {e}")
            return False
        if resp is None:
            self._anomaly(f"{batch.protocol} batch {batch.id}: no answer")
            return False
        accepted = ok(resp.status, resp.body)
        if not accepted:
            self._anomaly(f"{batch.protocol} batch {batch.id} refused: {resp.status} {resp.body!r}")
        self.ledger.answered(batch.id, accepted)
        return True


def raccoon_ok(status: int, body: bytes) -> bool:
    return status == 200 and raccoon_response(body).status == raccoon.Status.SUCCESS


def segment_ok(status: int, body: bytes) -> bool:
    return status == 200 and body == segment.SUCCESS_BODY
