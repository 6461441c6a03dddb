"""headwater's own Kafka producer, on asyncio: idempotent, ``acks=all``, batches built as they
are sent.

Why our own: the collector holds a request's events together and answers the request once they
are durable. librdkafka, through confluent-kafka, takes one Python call and gives one delivery
report per event, which cost the collector more than everything else it does per event. Here a
caller hands over a ``Chunk`` (a run of records for one partition, encoded only when sent) and
gets one future for it.

How a chunk travels:

- ``send(topic, partition, chunk)`` queues it on its partition and schedules a drain.
- A drain builds, for every partition with queued chunks whose leader's connection has room
  (``max_in_flight`` requests), one record batch of the chunks queued so far (up to
  ``max_batch_bytes``), numbers it with the partition's next sequence, and sends one Produce
  request per leader with a batch per partition. While requests are in flight chunks queue
  up, so the next batch holds what came meanwhile: group commit, no linger.
- The answer resolves each chunk's future with its first offset.

Idempotence (KIP-98) makes retries safe: a batch is sent again with the same producer id, epoch
and sequence, and the broker drops a duplicate of any of the last five. What can happen to a
batch, and what the producer does:

- a retriable error (leader moved, not enough replicas, a timeout, the connection lost): sent
  again in sequence order once the partition has nothing in flight, after a backoff and, when
  the leader moved or the connection broke, a metadata refresh;
- ``OUT_OF_ORDER_SEQUENCE_NUMBER`` after an earlier batch of the partition failed: the broker
  refused it because of the gap, so it waits its turn like the earlier one;
- a terminal error (too large, invalid, not authorized): its chunks fail with it, which leaves
  a gap in the partition's sequence;
- a batch past ``delivery_timeout_s``: its chunks fail, which leaves a gap too;
- the broker not knowing the producer id (``UNKNOWN_PRODUCER_ID``, a fenced epoch, an
  unexplained out-of-order sequence).

A gap or an unknown producer is healed by a reset: sending pauses, everything in flight is
answered, the batches whose outcome is unknown (sent, then the connection broke or the time ran
out) fail, since sending them under a new producer id could write them twice; the others are
numbered again under a new producer id and sent. A chunk's future fails only with
``BusUnavailable`` (retry later: it may or may not be on Kafka) or a terminal bus error (it is
not); it succeeds only once every in-sync replica has it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from headwater.bus.errors import BusClosed, BusError, BusUnavailable, RecordTooLarge, UnknownTopic
from headwater.bus.kafka.config import KafkaBusConfig
from headwater.bus.kafka.connection import Connection, ConnectionLost
from headwater.bus.kafka.protocol import api, records
from headwater.bus.kafka.protocol import errors as codes
from headwater.bus.kafka.protocol.codec import ProtocolError
from headwater.bus.records import Message
from headwater.bus.room import Room

log = logging.getLogger(__name__)

_SEQUENCE_WRAP = 1 << 31  # sequences count up to Int32.MAX, then start at 0 again
_BACKOFF_S = (0.05, 1.0)  # retry backoff: first, largest
_TICK_S = 0.25  # deadlines and metadata are checked this often
CODECS = {"none": records.NONE, "lz4": records.LZ4}  # bus.kafka.compression


class Chunk(Protocol):
    """Records for one partition, encoded when their batch is made."""

    @property
    def count(self) -> int: ...

    @property
    def size(self) -> int:
        """At least the encoded size, in bytes (for batch limits and the buffer)."""
        ...

    @property
    def first_timestamp(self) -> int:
        """The smallest timestamp of its records (ms)."""
        ...

    @property
    def last_timestamp(self) -> int:
        """The largest (ms)."""
        ...

    def records(self, first_delta: int, base_timestamp: int) -> bytes:
        """The encoded records, offset deltas from ``first_delta``, timestamps as deltas from
        ``base_timestamp``."""
        ...


class MessageChunk:
    """A run of bus ``Message``s (their timestamps set) as a chunk."""

    __slots__ = ("count", "first_timestamp", "last_timestamp", "messages", "size")

    def __init__(self, messages: Sequence[Message]) -> None:
        if not messages:
            raise ValueError("a chunk holds at least one message")
        self.messages = messages
        self.count = len(messages)
        stamps = [m.timestamp or 0 for m in messages]
        self.first_timestamp = min(stamps)
        self.last_timestamp = max(stamps)
        self.size = sum(records.record_size(m.key, m.value, m.headers) for m in messages)

    def records(self, first_delta: int, base_timestamp: int) -> bytes:
        return records.encode_messages(self.messages, first_delta, base_timestamp)


@dataclass(slots=True, eq=False)
class _Entry:
    chunk: Chunk
    future: asyncio.Future[int]
    deadline: float


@dataclass(slots=True, eq=False)  # identity: a batch is one send, whatever its bytes
class _Batch:
    entries: list[tuple[_Entry, int]]  # each chunk and its first offset delta
    records: bytes
    count: int
    base_timestamp: int
    max_timestamp: int
    order: int = 0  # the partition's batches in the order made (sequences wrap; this does not)
    node: int = -1  # the broker it was last sent to
    sequence: int = -1
    header: bytes = b""
    in_doubt: bool = False  # sent, and its outcome unknown (the answer never came)
    deadline: float = 0.0

    @property
    def size(self) -> int:
        return len(self.records)


@dataclass(slots=True, eq=False)
class _Partition:
    topic: str
    index: int
    leader: int = -1
    queue: collections.deque[_Entry] = field(default_factory=collections.deque)
    inflight: list[_Batch] = field(default_factory=list)
    retry: list[_Batch] = field(default_factory=list)  # by sequence
    retry_at: float = 0.0
    attempts: int = 0
    next_sequence: int = 0


@dataclass(slots=True)
class SenderStats:
    """What happened so far (tests and the console read it)."""

    batches: int = 0
    requests: int = 0
    retries: int = 0
    resets: int = 0
    failed_chunks: int = 0


class KafkaSender:
    """An idempotent ``acks=all`` producer on the running event loop."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_id: str = "headwater",
        request_timeout_s: float = 30.0,
        delivery_timeout_s: float = 120.0,
        max_in_flight: int = 2,
        max_batch_bytes: int = 1_000_000,
        buffer_bytes: int = 64 << 20,
        compression: int = records.NONE,
    ) -> None:
        if not 1 <= max_in_flight <= 5:
            raise ValueError("an idempotent producer keeps 1 to 5 requests in flight")
        self.bootstrap = [_address(a) for a in bootstrap_servers.split(",") if a.strip()]
        if not self.bootstrap:
            raise ValueError("no bootstrap servers")
        self.client_id = client_id
        self.request_timeout_s = request_timeout_s
        self.delivery_timeout_s = delivery_timeout_s
        self.max_in_flight = max_in_flight
        self.max_batch_bytes = max_batch_bytes
        self.buffer_bytes = buffer_bytes
        self.compression = compression
        self.stats = SenderStats()
        self.producer_id = -1
        self.producer_epoch = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._brokers: dict[int, tuple[str, int]] = {}
        self._conns: dict[int, Connection] = {}
        self._bootstrap: Connection | None = None  # to a bootstrap address, node unknown
        self._connecting: dict[int, asyncio.Task[None]] = {}
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._counts: dict[str, int] = {}  # partitions per topic, from metadata
        self._leaders: dict[tuple[str, int], int] = {}  # from metadata
        self._order = itertools.count()
        self._ready: set[_Partition] = set()
        self._drain_scheduled = False
        self._refresh_task: asyncio.Task[None] | None = None
        self._refresh_again = False
        self._reset_task: asyncio.Task[None] | None = None
        self._resetting = False
        self._room = Room(buffer_bytes)  # unanswered bytes (chunk sizes), handed out in turn
        self._idle: list[asyncio.Future[None]] = []  # flush(): nothing buffered
        self._quiet: list[asyncio.Future[None]] = []  # resets: nothing in flight
        self._tick: asyncio.TimerHandle | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: KafkaBusConfig, client_id: str) -> KafkaSender:
        """The producer ``bus.kafka`` describes."""
        return cls(
            config.bootstrap_servers,
            client_id=client_id,
            request_timeout_s=config.timeout_s,
            delivery_timeout_s=config.delivery_timeout_s,
            max_in_flight=config.max_in_flight,
            max_batch_bytes=config.batch_bytes,
            buffer_bytes=config.buffer_bytes,
            compression=CODECS[config.compression],
        )

    # -- life -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, learn the cluster and get a producer id (``BusUnavailable`` if it cannot
        within the request timeout)."""
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                await self._learn(None)
                await self._init_producer_id()
                break
            except (ConnectionLost, BusUnavailable) as e:
                if time.monotonic() > deadline:
                    raise BusUnavailable(f"cannot reach the Kafka cluster: {e}") from None
                await asyncio.sleep(_BACKOFF_S[0])
        self._tick = self._loop.call_later(_TICK_S, self._on_tick)

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what was sent, then fail what is left (``BusClosed``)."""
        if self._closed:
            return
        try:
            await self.flush(timeout_s)
        except BusUnavailable:
            log.warning("closing the Kafka producer with %d bytes unacknowledged", self._room.used)
        self._closed = True
        if self._tick is not None:
            self._tick.cancel()
        for task in [*self._tasks, *self._connecting.values()]:
            task.cancel()
        for p in self._partitions.values():
            batches = [*p.retry, *p.inflight]
            for b in batches:
                self._fail(b.entries, BusClosed("the producer closed before Kafka answered"))
            entries = list(p.queue)
            p.queue.clear()
            self._fail([(e, 0) for e in entries], BusClosed("the producer closed"))
            p.retry.clear()
            p.inflight.clear()
        conns = [c for c in (*self._conns.values(), self._bootstrap) if c is not None]
        for conn in conns:
            conn.close()
        self._conns.clear()
        self._bootstrap = None
        if conns:  # let the transports finish closing before the loop may stop
            await asyncio.wait([c.closed for c in conns], timeout=1.0)

    async def flush(self, timeout_s: float | None) -> None:
        """Wait until everything sent so far is answered (``BusUnavailable`` on timeout)."""
        if self._room.used == 0:
            return
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._idle.append(future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise BusUnavailable(
                f"{self._room.used:,} bytes were not acknowledged within {timeout_s} s"
            ) from None

    @property
    def buffered(self) -> int:
        """Bytes handed over and not yet answered."""
        return self._room.used

    # -- metadata ---------------------------------------------------------------------------
    def partitions(self, topic: str) -> int | None:
        """The topic's partition count as last learned (None: not known yet)."""
        return self._counts.get(topic)

    async def learn(self, topic: str) -> int | None:
        """Ask the cluster for ``topic``; its partition count, None if it does not exist."""
        await self._learn([topic])
        return self._counts.get(topic)

    async def _learn(self, topics: list[str] | None) -> None:
        conn = await self._any_connection()
        version = conn.versions[api.API_METADATA]
        body = await conn.request(api.API_METADATA, version, api.metadata_request(topics or []))
        self._apply(api.metadata_response(body))

    def _apply(self, meta: api.Metadata) -> None:
        if meta.brokers:
            self._brokers = meta.brokers
        for name, topic in meta.topics.items():
            if topic.error == codes.NONE and topic.partitions:
                self._counts[name] = len(topic.partitions)
            elif topic.error == codes.UNKNOWN_TOPIC_OR_PARTITION:
                self._counts.pop(name, None)
            for pm in topic.partitions:
                # REPLICA_NOT_AVAILABLE (9) names the leader all the same
                leader = pm.leader if pm.error in (codes.NONE, 9) else -1
                self._leaders[(name, pm.index)] = leader
                p = self._partitions.get((name, pm.index))
                if p is not None:
                    p.leader = leader
        for node in list(self._conns):
            if node not in self._brokers:
                self._conns.pop(node).close()

    async def _any_connection(self) -> Connection:
        for conn in (*self._conns.values(), self._bootstrap):
            if conn is not None and conn.usable:
                return conn
        errors = []
        candidates = list(self._brokers.items()) or [(-1, a) for a in self.bootstrap]
        random.shuffle(candidates)
        for node, address in candidates:
            try:
                conn = await self._open(address)
            except ConnectionLost as e:
                errors.append(str(e))
                continue
            if node >= 0:
                old = self._conns.get(node)
                if old is not None:
                    old.close()
                self._conns[node] = conn
            else:
                if self._bootstrap is not None:
                    self._bootstrap.close()
                self._bootstrap = conn
            return conn
        raise ConnectionLost("; ".join(errors) or "no broker to connect to")

    async def _open(self, address: tuple[str, int]) -> Connection:
        host, port = self.route(*address)
        return await Connection.open(
            host, port, client_id=self.client_id, timeout_s=self.request_timeout_s
        )

    def route(self, host: str, port: int) -> tuple[str, int]:
        """Where to connect to reach the broker the cluster calls ``host:port`` (itself; a test
        puts a proxy there)."""
        return host, port

    def _refresh(self) -> None:
        """Ask again where the partitions' leaders are (one refresh at a time)."""
        if self._closed:
            return
        if self._refresh_task is not None:
            self._refresh_again = True
            return
        self._refresh_task = self._spawn(self._refreshing())

    async def _refreshing(self) -> None:
        try:
            while True:
                self._refresh_again = False
                topics = sorted({p.topic for p in self._partitions.values()})
                try:
                    await self._learn(topics)
                except (ConnectionLost, ProtocolError) as e:
                    log.warning("Kafka metadata refresh failed: %s", e)
                    await asyncio.sleep(_BACKOFF_S[0] * 4)
                    self._refresh_again = True
                if not self._refresh_again:
                    break
        finally:
            self._refresh_task = None
        self._schedule()

    def _connect(self, node: int) -> None:
        if node in self._connecting or node not in self._brokers or self._closed:
            return
        host, port = self._brokers[node]

        async def connecting() -> None:
            try:
                conn = await self._open((host, port))
            except (ConnectionLost, ProtocolError) as e:
                log.warning("cannot connect to Kafka broker %d (%s:%d): %s", node, host, port, e)
                await asyncio.sleep(_BACKOFF_S[0] * 4)
                self._refresh()
            else:
                if self._closed:
                    conn.close()
                    return
                old = self._conns.get(node)
                if old is not None:
                    old.close()
                self._conns[node] = conn
            finally:
                self._connecting.pop(node, None)
                self._schedule()

        self._connecting[node] = self._spawn(connecting())

    async def _init_producer_id(self) -> None:
        conn = await self._any_connection()
        version = conn.versions[api.API_INIT_PRODUCER_ID]
        body = await conn.request(api.API_INIT_PRODUCER_ID, version, api.init_producer_id_request())
        error, pid, epoch = api.init_producer_id_response(body)
        if error:
            kind = codes.code(error)
            raise BusUnavailable(f"the Kafka cluster gave no producer id: {kind.name}")
        self.producer_id, self.producer_epoch = pid, epoch

    # -- sending ----------------------------------------------------------------------------
    def send(self, topic: str, partition: int, chunk: Chunk) -> asyncio.Future[int]:
        """Queue ``chunk`` for ``topic[partition]``; its first offset once every in-sync
        replica has it."""
        loop = self._loop
        assert loop is not None, "start() first"
        future: asyncio.Future[int] = loop.create_future()
        if self._closed:
            future.set_exception(BusClosed("the Kafka producer is closed"))
            return future
        p = self._partitions.get((topic, partition))
        if p is None:
            count = self._counts.get(topic)
            if count is not None and not 0 <= partition < count:
                future.set_exception(
                    UnknownTopic(f"topic {topic!r} has no partition {partition} (it has {count})")
                )
                return future
            leader = self._leaders.get((topic, partition), -1)
            p = self._partitions[(topic, partition)] = _Partition(topic, partition, leader)
            if leader < 0:
                self._refresh()
        p.queue.append(_Entry(chunk, future, time.monotonic() + self.delivery_timeout_s))
        self._room.take(chunk.size)
        self._ready.add(p)
        self._schedule()
        return future

    async def room(self, nbytes: int, timeout_s: float, *, hold: bool = True) -> None:
        """Wait in turn until ``nbytes`` more fit the buffer, and hold that room for the
        ``send`` that follows (``hold=False``: only wait); ``BusUnavailable`` after
        ``timeout_s`` (``bus.room``)."""
        if not await self._room.wait(nbytes, timeout_s, hold=hold):
            raise BusUnavailable(
                f"the Kafka producer holds {self._room.used:,} unacknowledged bytes "
                f"(buffer {self.buffer_bytes:,}: bus.kafka.buffer_bytes) and no room came "
                f"within {timeout_s:.0f} s; retry shortly"
            )

    def _schedule(self) -> None:
        if not self._drain_scheduled and self._loop is not None and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Send a batch for every partition that can take one now."""
        self._drain_scheduled = False
        if self._resetting or self._closed:
            return
        now = time.monotonic()
        requests: dict[int, dict[tuple[str, int], _Batch]] = {}
        again = False
        for p in list(self._ready):
            if not p.queue and not p.retry:
                self._ready.discard(p)
                continue
            if p.leader < 0:
                self._refresh()
                continue
            conn = self._conns.get(p.leader)
            if conn is None or not conn.usable:
                self._connect(p.leader)
                continue
            outgoing = requests.setdefault(p.leader, {})
            if conn.in_flight >= self.max_in_flight or (p.topic, p.index) in outgoing:
                continue
            if p.inflight and p.inflight[0].node != p.leader:
                continue  # the leader moved: its batches on the old one are answered first
            if p.retry:
                if p.inflight or now < p.retry_at:
                    continue
                batch = p.retry.pop(0)
                self.stats.retries += 1
            else:
                batch = self._batch(p)
            batch.node = p.leader
            p.inflight.append(batch)
            outgoing[(p.topic, p.index)] = batch
            again = again or bool(p.queue or p.retry)
        for node, batches in requests.items():
            if batches:
                self._request(self._conns[node], batches)
        if again:
            self._schedule()

    def _batch(self, p: _Partition) -> _Batch:
        entries: list[tuple[_Entry, int]] = []
        size = count = 0
        while p.queue and (not entries or size + p.queue[0].chunk.size <= self.max_batch_bytes):
            entry = p.queue.popleft()
            entries.append((entry, count))
            count += entry.chunk.count
            size += entry.chunk.size
        base = min(e.chunk.first_timestamp for e, _ in entries)
        top = max(e.chunk.last_timestamp for e, _ in entries)
        data = records.compress(
            b"".join([e.chunk.records(delta, base) for e, delta in entries]), self.compression
        )
        batch = _Batch(entries, data, count, base, top, next(self._order))
        batch.deadline = min(e.deadline for e, _ in entries)
        self._number(p, batch)
        self.stats.batches += 1
        return batch

    def _number(self, p: _Partition, batch: _Batch) -> None:
        batch.sequence = p.next_sequence
        p.next_sequence = (p.next_sequence + batch.count) % _SEQUENCE_WRAP
        batch.header = records.header(
            batch.records,
            batch.count,
            base_timestamp=batch.base_timestamp,
            max_timestamp=batch.max_timestamp,
            producer_id=self.producer_id,
            producer_epoch=self.producer_epoch,
            base_sequence=batch.sequence,
            compression=self.compression,
        )

    def _request(self, conn: Connection, batches: dict[tuple[str, int], _Batch]) -> None:
        data: api.ProduceData = {}
        for (topic, index), b in batches.items():
            data.setdefault(topic, []).append((index, [b.header, b.records]))
        version = conn.versions[api.API_PRODUCE]
        timeout_ms = int(self.request_timeout_s * 1000)
        future = conn.request(api.API_PRODUCE, version, api.produce_request(-1, timeout_ms, data))
        self.stats.requests += 1
        future.add_done_callback(lambda f: self._answered(f, version, batches))

    # -- answers ----------------------------------------------------------------------------
    def _answered(
        self, future: asyncio.Future[bytes], version: int, batches: dict[tuple[str, int], _Batch]
    ) -> None:
        error = future.exception()
        results: dict[tuple[str, int], api.PartitionResult] = {}
        if error is None:
            try:
                for topic, parts in api.produce_response(future.result(), version).items():
                    for r in parts:
                        results[(topic, r.index)] = r
            except ProtocolError as e:
                error = e
        for key, batch in batches.items():
            p = self._partitions[key]
            if batch in p.inflight:
                p.inflight.remove(batch)
            result = results.get(key)
            if result is None:  # no answer for it: it may or may not have been written
                batch.in_doubt = True
                why = error or "the answer left the partition out"
                self._again(p, batch, f"appending to {p.topic}[{p.index}]: no answer ({why})")
                self._refresh()
            else:
                self._outcome(p, batch, result)
        self._settled()
        self._schedule()

    def _outcome(self, p: _Partition, batch: _Batch, result: api.PartitionResult) -> None:
        error = result.error
        if error in (codes.NONE, codes.DUPLICATE_SEQUENCE_NUMBER):
            base = result.base_offset if error == codes.NONE else -1
            for entry, delta in batch.entries:
                if not entry.future.done():
                    entry.future.set_result(base + delta if base >= 0 else -1)
            self._release(batch)
            p.attempts = 0
            return
        kind = codes.code(error)
        where = f"appending to {p.topic}[{p.index}]: {kind.name}"
        if result.message:
            where += f" ({result.message})"
        if error == codes.OUT_OF_ORDER_SEQUENCE_NUMBER and any(
            b.order < batch.order for b in (*p.retry, *p.inflight)
        ):
            self._again(p, batch, where)  # refused because an earlier batch failed first
        elif error in (
            codes.OUT_OF_ORDER_SEQUENCE_NUMBER,
            codes.UNKNOWN_PRODUCER_ID,
            codes.INVALID_PRODUCER_EPOCH,
            codes.PRODUCER_FENCED,
        ):
            log.warning("%s: starting again under a new producer id", where)
            self._again(p, batch, where)
            self._reset()
        elif kind.retriable:
            if error == codes.NOT_ENOUGH_REPLICAS_AFTER_APPEND:
                batch.in_doubt = True
            self._again(p, batch, where)
            if error in codes.LEADER_MOVED:
                self._refresh()
        else:
            self._fail(batch.entries, _terminal(error, where))
            self._release(batch)
            self._reset()  # the batch's sequence numbers are a gap now

    def _again(self, p: _Partition, batch: _Batch, why: str) -> None:
        if time.monotonic() >= batch.deadline:
            self._abandon(p, batch, why)
            return
        p.retry.append(batch)
        p.retry.sort(key=lambda b: b.order)
        p.attempts += 1
        first, largest = _BACKOFF_S
        delay = min(largest, first * 2 ** min(p.attempts - 1, 5))
        p.retry_at = time.monotonic() + delay
        self._ready.add(p)
        assert self._loop is not None
        self._loop.call_later(delay, self._schedule)
        log.debug("%s: will send again (attempt %d)", why, p.attempts)

    def _abandon(self, p: _Partition, batch: _Batch, why: str) -> None:
        self._fail(
            batch.entries,
            BusUnavailable(
                f"{why}; given up after {self.delivery_timeout_s:.0f} s "
                "(the events may or may not be on Kafka)"
            ),
        )
        self._release(batch)
        self._reset()

    def _fail(self, entries: list[tuple[_Entry, int]], error: BaseException) -> None:
        for entry, _ in entries:
            if not entry.future.done():
                entry.future.set_exception(error)
                self.stats.failed_chunks += 1

    def _release(self, batch: _Batch) -> None:
        self._room.release(sum(e.chunk.size for e, _ in batch.entries))

    def _settled(self) -> None:
        if self._quiet and not any(p.inflight for p in self._partitions.values()):
            quiet, self._quiet = self._quiet, []
            for f in quiet:
                if not f.done():
                    f.set_result(None)
        if self._room.used == 0 and self._idle:
            idle, self._idle = self._idle, []
            for f in idle:
                if not f.done():
                    f.set_result(None)

    # -- resets -----------------------------------------------------------------------------
    def _reset(self) -> None:
        if self._reset_task is None and not self._closed:
            self._resetting = True
            self._reset_task = self._spawn(self._resetting_producer())

    async def _resetting_producer(self) -> None:
        """Pause, let everything in flight be answered, fail what is in doubt, number the
        rest again under a new producer id."""
        try:
            if any(p.inflight for p in self._partitions.values()):
                assert self._loop is not None
                quiet: asyncio.Future[None] = self._loop.create_future()
                self._quiet.append(quiet)
                await quiet
            for p in self._partitions.values():
                kept = []
                for b in p.retry:
                    if b.in_doubt:
                        self._fail(
                            b.entries,
                            BusUnavailable(
                                f"appending to {p.topic}[{p.index}]: the outcome is unknown "
                                "(sent, never answered) and the producer had to start again"
                            ),
                        )
                        self._release(b)
                    else:
                        kept.append(b)
                p.retry = kept
                p.next_sequence = 0
            while not self._closed:
                try:
                    await self._init_producer_id()
                    break
                except (ConnectionLost, BusUnavailable, ProtocolError) as e:
                    log.warning("no new Kafka producer id yet: %s", e)
                    await asyncio.sleep(_BACKOFF_S[1])
            for p in self._partitions.values():
                for b in p.retry:
                    self._number(p, b)
                p.attempts = 0
                p.retry_at = 0.0
                if p.retry:
                    self._ready.add(p)
            self.stats.resets += 1
        finally:
            self._resetting = False
            self._reset_task = None
            self._settled()
            self._schedule()

    # -- time -------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        """Fail chunks past their delivery timeout that were never sent; wake retries whose
        backoff ended; look for leaders still unknown."""
        if self._closed:
            return
        assert self._loop is not None
        now = time.monotonic()
        for p in self._partitions.values():
            while p.queue and p.queue[0].deadline <= now:
                entry = p.queue.popleft()
                self._fail(
                    [(entry, 0)],
                    BusUnavailable(
                        f"appending to {p.topic}[{p.index}]: not sent within "
                        f"{self.delivery_timeout_s:.0f} s (no leader, or no connection to it)"
                    ),
                )
                self._room.release(entry.chunk.size)
            if (p.queue or p.retry) and p.leader < 0:
                self._refresh()
            if p.retry and not p.inflight and not self._resetting:
                expired = [b for b in p.retry if b.deadline <= now]
                for b in expired:
                    p.retry.remove(b)
                    self._abandon(p, b, f"appending to {p.topic}[{p.index}]")
        self._settled()
        self._schedule()
        self._tick = self._loop.call_later(_TICK_S, self._on_tick)

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _terminal(error: int, where: str) -> BusError:
    if error in (codes.MESSAGE_TOO_LARGE, codes.RECORD_LIST_TOO_LARGE):
        return RecordTooLarge(where)
    return BusError(where)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)
