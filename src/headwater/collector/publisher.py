"""Publishing a request's events to the log, and the two ack modes.

``publish`` validates the whole request first (types route to valid topics, every record fits),
so bad input publishes nothing. Then it appends one batch per topic (and partition). With
``ack: durable`` it returns once every batch is durable; with ``ack: received`` it returns at
once and counts any later failure. When the log cannot take the events (its write queue is full,
it failed, or an admission budget is exceeded) the request is refused with a retry-after;
nothing is acked that was not stored.

A request's events go straight into the log's own encoding, with no bus ``Message`` per event,
and are appended by a ``LogSink``: on the embedded log the columnar batch (``collector.batch``)
for the log in this process (``collector.local``) or, in an intake worker, for the link to the
process that holds it (``collector.link``); on Kafka, records for headwater's own producer
(``collector.kafka_sink``). With ``bus.kafka.producer_client: librdkafka`` each event is a
message for the bus's producer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from headwater.bus.base import Bus
from headwater.bus.errors import BusError, BusUnavailable, InvalidArgument, RecordTooLarge
from headwater.bus.partitioner import Partitioner
from headwater.bus.records import Message, Position
from headwater.bus.validation import validate_batch
from headwater.collector.admission import Admission
from headwater.collector.errors import Rejected, bad_request, too_large, unavailable
from headwater.collector.events import EventIn, RequestContext, to_messages
from headwater.collector.metrics import Metrics, TypeCounts, type_counts
from headwater.collector.routing import Router

log = logging.getLogger(__name__)


Encoded = list[tuple[str, int | None, Any]]


class LogSink(Protocol):
    """Where encoded batches go: ``(topic, partition or None for the next in turn, batch)``,
    each batch in the sink's own encoding."""

    def encode_events(
        self, events: Sequence[EventIn], ctx: RequestContext, max_record_bytes: int, topic: str
    ) -> list[tuple[int | None, Any]]:
        """A request's unkeyed events for ``topic`` (``RecordTooLarge``, ``InvalidArgument``
        as ``validate_batch``)."""
        ...

    def encode_messages(self, messages: Sequence[Message], now_ms: int) -> Any:
        """Validated messages for one partition."""
        ...

    def size(self, batch: Any) -> int:
        """A batch's bytes, as ``room`` counts them."""
        ...

    async def finish(self) -> None:
        """Wait for what was appended, then let go (the collector is stopping)."""
        ...

    def append(self, batches: Encoded) -> Awaitable[list[int]]:
        """Queue all or none now (or raise ``BusUnavailable``); the base offsets once
        durable."""
        ...

    async def room(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may be queued (backpressure), or raise
        ``BusUnavailable`` when no room comes in time."""
        ...

    async def partitions(self, topic: str) -> int: ...


class Publisher:
    def __init__(
        self,
        bus: Bus | None,
        *,
        durable: bool,
        max_record_bytes: int,
        admission: Admission,
        metrics: Metrics,
        retry_after_s: int,
        sink: LogSink | None = None,
    ) -> None:
        self.bus = bus
        self.durable = durable
        self.max_record_bytes = max_record_bytes
        self.admission = admission
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        if sink is None and bus is not None:
            sink = _sink_for(bus)
        self.sink = sink
        self._partitioner = Partitioner()
        self._pending: set[asyncio.Task[None]] = set()  # received-mode appends

    async def publish(self, events: Sequence[EventIn], ctx: RequestContext, router: Router) -> None:
        """Store ``events`` (all of them, or none on bad input) and wait as the ack mode says."""
        if not events:
            raise bad_request("the request has no events", kind="empty")
        by_topic = router.group(events)
        if self.sink is not None:
            await self._publish_encoded(self.sink, events, by_topic, ctx)
            return
        batches = {topic: to_messages(evs, ctx) for topic, evs in by_topic.items()}
        for topic, messages in batches.items():
            try:
                validate_batch(topic, messages, self.max_record_bytes)
            except (RecordTooLarge, InvalidArgument) as e:
                raise self._bad(e, events, by_topic[topic]) from None
        futures = self._append(batches)
        counts = self._count_received(events, ctx)
        if not self.durable:
            for f in futures:
                f.add_done_callback(self._after_received_ack)
            return
        await self._durable(futures)
        self.metrics.published(counts)

    async def _publish_encoded(
        self,
        sink: LogSink,
        events: Sequence[EventIn],
        by_topic: dict[str, list[EventIn]],
        ctx: RequestContext,
    ) -> None:
        batches: Encoded = []
        for topic, evs in by_topic.items():
            try:
                if all(e.key is None for e in evs):
                    batches += [
                        (topic, partition, batch)
                        for partition, batch in sink.encode_events(
                            evs, ctx, self.max_record_bytes, topic
                        )
                    ]
                else:
                    batches += await self._keyed(sink, topic, evs, ctx)
            except (RecordTooLarge, InvalidArgument) as e:
                raise self._bad(e, events, evs) from None
            except BusUnavailable as e:
                raise unavailable(
                    f"the log cannot take events now: {e.message}", self.retry_after_s
                ) from None
        appended = await self._queue(sink, batches)
        counts = self._count_received(events, ctx)
        if not self.durable:
            task = asyncio.ensure_future(self._received(appended))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return
        try:
            await appended
        except (BusUnavailable, BusError) as e:
            raise self._unavailable(e) from None
        self.metrics.published(counts)

    async def _keyed(
        self, sink: LogSink, topic: str, evs: list[EventIn], ctx: RequestContext
    ) -> Encoded:
        """Keyed events: one batch per partition, by the key's hash (as the bus would)."""
        return await self._split(sink, topic, to_messages(evs, ctx), ctx.received_ms)

    async def _split(
        self, sink: LogSink, topic: str, messages: list[Message], now_ms: int
    ) -> Encoded:
        validate_batch(topic, messages, self.max_record_bytes)
        groups = self._partitioner.split(topic, await sink.partitions(topic), messages)
        return [
            (topic, p, sink.encode_messages([messages[i] for i in idx], now_ms))
            for p, idx in groups.items()
        ]

    async def _queue(self, sink: LogSink, batches: Encoded) -> Awaitable[list[int]]:
        """Queue ``batches`` once the sink has room for them; their answer to await."""
        try:
            self.admission.check()  # before room: room granted is held for the append
            await sink.room(sum(sink.size(b) for _, _, b in batches))
            return sink.append(batches)
        except BusUnavailable as e:
            raise unavailable(
                f"the log cannot take events now: {e.message}", self.retry_after_s
            ) from None

    def _bad(
        self, e: RecordTooLarge | InvalidArgument, events: Sequence[EventIn], evs: list[EventIn]
    ) -> Rejected:
        if not isinstance(e, RecordTooLarge):
            return bad_request(e.message)
        event = events.index(evs[e.index])
        return too_large(
            f"event {event} (type {evs[e.index].type!r}) is {e.size} bytes "
            f"with its context headers; the limit is {self.max_record_bytes} "
            "(the bus's max_record_bytes)"
        )

    def _count_received(self, events: Sequence[EventIn], ctx: RequestContext) -> TypeCounts:
        """Count ``events`` as received; their tally, to count them published with."""
        counts = type_counts(events)
        self.metrics.received(counts, ctx.protocol)
        self.metrics.from_source(ctx.source, ctx.protocol, len(events))
        return counts

    async def _received(self, appended: Awaitable[list[int]]) -> None:
        try:
            await appended
        except (BusUnavailable, BusError) as e:
            self.metrics.lost_after_ack()
            log.error("events acked on receipt were not stored: %s", e)

    def _unavailable(self, e: BusUnavailable | BusError) -> Rejected:
        if isinstance(e, BusUnavailable):
            return unavailable(
                f"the log could not store the events: {e.message}", self.retry_after_s
            )
        log.error("publish failed: %s", e)
        return unavailable(f"the log refused the events: {e.message}", self.retry_after_s)

    async def store(self, batches: dict[str, list[Message]]) -> None:
        """Append validated ``batches`` and return once they are durable, whatever the ack
        mode (the webhook intake's 202 means the message is on the log)."""
        if self.sink is None:
            await self._durable(self._append(batches))
            return
        now = time.time_ns() // 1_000_000
        encoded: Encoded = []
        for topic, messages in batches.items():
            encoded += await self._split(self.sink, topic, list(messages), now)
        try:
            await (await self._queue(self.sink, encoded))
        except (BusUnavailable, BusError) as e:
            raise self._unavailable(e) from None

    async def _durable(self, futures: list[Future[Sequence[Position]]]) -> None:
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except (BusUnavailable, BusError) as e:
            raise self._unavailable(e) from None

    def _append(self, batches: dict[str, list[Message]]) -> list[Future[Sequence[Position]]]:
        self.admission.check()
        try:
            return self.bus.append_many(batches)
        except BusUnavailable as e:
            raise unavailable(
                f"the log cannot take events now: {e.message}", self.retry_after_s
            ) from None

    async def finish(self) -> None:
        """Wait for the appends acked on receipt, then for the sink's (the collector is
        stopping and has answered its last request)."""
        if self._pending:
            await asyncio.wait(list(self._pending))
        if self.sink is not None:
            await self.sink.finish()

    def _after_received_ack(self, future: Future[Sequence[Position]]) -> None:
        error = future.exception()
        if error is not None:
            self.metrics.lost_after_ack()
            log.error("events acked on receipt were not stored: %s", error)


def _sink_for(bus: Bus) -> LogSink | None:
    """The sink a bus open in this process takes encoded batches through, if it has one."""
    if hasattr(bus, "append_encoded"):
        from headwater.collector.local import LocalSink

        return LocalSink(bus)  # type: ignore[arg-type]
    if bus.backend == "kafka":
        from headwater.collector.kafka_sink import sink_for

        return sink_for(bus)
    return None
