"""Publishing a request's events to the log, and the two ack modes.

``publish`` validates the whole request first (types route to valid topics, every record fits),
so bad input publishes nothing. Then it appends one batch per topic. With ``ack: durable`` it
returns once every batch is durable; with ``ack: received`` it returns at once and counts any
later failure. When the log cannot take the events (its write queue is full, it failed, or an
admission budget is exceeded) the request is refused with a retry-after; nothing is acked that
was not stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from headwater.bus.base import Bus
from headwater.bus.errors import BusError, BusUnavailable, InvalidArgument, RecordTooLarge
from headwater.bus.records import Message, Position
from headwater.bus.validation import validate_batch
from headwater.collector.admission import Admission
from headwater.collector.errors import bad_request, too_large, unavailable
from headwater.collector.events import EventIn, RequestContext, to_messages
from headwater.collector.metrics import Metrics
from headwater.collector.routing import Router

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        bus: Bus,
        *,
        durable: bool,
        max_record_bytes: int,
        admission: Admission,
        metrics: Metrics,
        retry_after_s: int,
    ) -> None:
        self.bus = bus
        self.durable = durable
        self.max_record_bytes = max_record_bytes
        self.admission = admission
        self.metrics = metrics
        self.retry_after_s = retry_after_s

    async def publish(self, events: Sequence[EventIn], ctx: RequestContext, router: Router) -> None:
        """Store ``events`` (all of them, or none on bad input) and wait as the ack mode says."""
        if not events:
            raise bad_request("the request has no events", kind="empty")
        by_topic: dict[str, list[EventIn]] = {}
        for e in events:
            by_topic.setdefault(router.topic(e.type), []).append(e)
        batches = {topic: to_messages(evs, ctx) for topic, evs in by_topic.items()}
        for topic, messages in batches.items():
            try:
                validate_batch(topic, messages, self.max_record_bytes)
            except RecordTooLarge as e:
                event = events.index(by_topic[topic][e.index])
                raise too_large(
                    f"event {event} (type {by_topic[topic][e.index].type!r}) is {e.size} bytes "
                    f"with its context headers; the limit is {self.max_record_bytes} "
                    "(the bus's max_record_bytes)"
                ) from None
            except InvalidArgument as e:
                raise bad_request(e.message) from None
        futures = self._append(batches)
        for topic, evs in by_topic.items():
            self.metrics.received(topic, evs, ctx.protocol)
        self.metrics.from_source(ctx.source, ctx.protocol, len(events))
        if not self.durable:
            for f in futures:
                f.add_done_callback(self._after_received_ack)
            return
        await self._durable(futures)
        for topic, evs in by_topic.items():
            self.metrics.published(topic, evs)

    async def store(self, batches: dict[str, list[Message]]) -> None:
        """Append validated ``batches`` and return once they are durable, whatever the ack
        mode (the webhook intake's 202 means the message is on the log)."""
        await self._durable(self._append(batches))

    async def _durable(self, futures: list[Future[Sequence[Position]]]) -> None:
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except BusUnavailable as e:
            raise unavailable(
                f"the log could not store the events: {e.message}", self.retry_after_s
            ) from None
        except BusError as e:
            log.error("publish failed: %s", e)
            raise unavailable(
                f"the log refused the events: {e.message}", self.retry_after_s
            ) from None

    def _append(self, batches: dict[str, list[Message]]) -> list[Future[Sequence[Position]]]:
        self.admission.check()
        try:
            return self.bus.append_many(batches)
        except BusUnavailable as e:
            raise unavailable(
                f"the log cannot take events now: {e.message}", self.retry_after_s
            ) from None

    def _after_received_ack(self, future: Future[Sequence[Position]]) -> None:
        error = future.exception()
        if error is not None:
            self.metrics.lost_after_ack()
            log.error("events acked on receipt were not stored: %s", error)


OnDone = Callable[[BaseException | None], None]
