"""Appending a request's events to Kafka with headwater's own producer, from asyncio.

``KafkaSink`` is the collector's ``LogSink`` on ``bus: kafka`` (``bus.kafka.producer_client:
headwater``): a request's events become one chunk of records per topic
(``collector.kafka_batch``), which the producer (``bus.kafka.sender``) sends in the record
batch of its partition with whatever other requests queued meanwhile, and the request is
answered once every in-sync replica has them. Each intake process has its own producer.

Topics are created (when ``auto_create_topics``) and counted through the ``KafkaBus`` the
process opened, as its other appends are; unkeyed events go to the topic's partitions in turn.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from headwater.bus.errors import BusError
from headwater.bus.kafka.backend import KafkaBus
from headwater.bus.kafka.sender import KafkaSender, MessageChunk
from headwater.bus.partitioner import Partitioner
from headwater.bus.records import Message
from headwater.collector.events import EventIn, RequestContext
from headwater.collector.kafka_batch import EventChunk, event_chunks

Chunk = EventChunk | MessageChunk
Batches = Sequence[tuple[str, int | None, Chunk]]


class KafkaSink:
    """A ``LogSink`` over a ``KafkaSender`` on the running event loop."""

    def __init__(self, bus: KafkaBus, *, close_timeout_s: float = 30.0) -> None:
        config = bus.config
        self.bus = bus
        self.sender = KafkaSender.from_config(config, f"headwater-collector-{os.getpid()}")
        self.room_timeout_s = config.timeout_s
        self.close_timeout_s = close_timeout_s
        self._partitioner = Partitioner()
        self._start: asyncio.Task[None] | None = None

    # -- encoding ---------------------------------------------------------------------------
    @staticmethod
    def encode_events(
        events: Sequence[EventIn], ctx: RequestContext, max_record_bytes: int, topic: str
    ) -> list[tuple[int | None, Chunk]]:
        return [(None, c) for c in event_chunks(events, ctx, max_record_bytes, topic)]

    @staticmethod
    def encode_messages(messages: Sequence[Message], now_ms: int) -> Chunk:
        return MessageChunk(
            [m if m.timestamp is not None else m._replace(timestamp=now_ms) for m in messages]
        )

    @staticmethod
    def size(chunk: Chunk) -> int:
        return chunk.size

    # -- appending --------------------------------------------------------------------------
    def append(self, batches: Batches) -> asyncio.Future[list[int]]:
        """Queue every chunk now; their first offsets once Kafka has them all."""
        if any(p is None and self.sender.partitions(t) is None for t, p, _ in batches):
            return asyncio.ensure_future(self._append_counted(batches))  # a topic's first use
        return asyncio.gather(*[self._send(t, p, c) for t, p, c in batches])

    async def _append_counted(self, batches: Batches) -> list[int]:
        for topic in {t for t, p, _ in batches if p is None}:
            await self.partitions(topic)
        return await asyncio.gather(*[self._send(t, p, c) for t, p, c in batches])

    def _send(self, topic: str, partition: int | None, chunk: Chunk) -> asyncio.Future[int]:
        if partition is None:
            count = self.sender.partitions(topic)
            assert count is not None
            partition = self._partitioner.next_unkeyed(count)
        return self.sender.send(topic, partition, chunk)

    async def room(self, nbytes: int) -> None:
        await self._started()
        await self.sender.room(nbytes, self.room_timeout_s)

    async def partitions(self, topic: str) -> int:
        await self._started()
        count = self.sender.partitions(topic)
        if count is None:
            count = await asyncio.to_thread(self.bus.partitions_for_append, topic)
            learned = await self.sender.learn(topic)
            if learned is None:
                raise BusError(f"topic {topic!r} was made but the cluster does not show it yet")
            count = learned
        return count

    async def _started(self) -> None:
        failed = self._start is not None and self._start.done() and self._start.exception()
        if self._start is None or failed:  # not started, or the cluster was out of reach
            self._start = asyncio.ensure_future(self.sender.start())
        await asyncio.shield(self._start)

    async def finish(self) -> None:
        """Wait for what was appended (at most ``close_timeout_s``), then close."""
        if self._start is None:
            return
        if not self._start.done():
            self._start.cancel()
        await self.sender.close(self.close_timeout_s)


def sink_for(bus: Any) -> KafkaSink | None:
    """The sink for ``bus`` when it is Kafka with headwater's producer, else None."""
    if isinstance(bus, KafkaBus) and bus.config.own_producer:
        return KafkaSink(bus)
    return None
