"""A consumer of the embedded log: one member per group, reading every partition of its topics
from the group's committed offsets."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from headwater.bus.base import Consumer
from headwater.bus.errors import BusClosed, InvalidArgument, OffsetOutOfRange, UnknownPartition
from headwater.bus.records import Record, TopicInfo, TopicPartition


class ConsumedLog(Protocol):
    """What a consumer needs of the embedded log (``EmbeddedBus``): the ``Bus`` reads and group
    offsets, and a way to wait for new records."""

    arrival_generation: int

    def topic(self, name: str) -> TopicInfo: ...

    def read(
        self, topic: str, partition: int, offset: int, max_records: int = ...
    ) -> list[Record]: ...

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]: ...

    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None: ...

    def committed(
        self, group: str, topics: Sequence[str] | None = None
    ) -> dict[TopicPartition, int]: ...

    def wait_for_arrivals(self, since: int, timeout: float) -> None: ...

    async def arrivals(self, since: int, timeout: float) -> None: ...


class EmbeddedConsumer(Consumer):
    polls_in_place = True  # (reads the log's mapped segments; offsets commit in memory)

    def __init__(self, bus: ConsumedLog, group: str, topics: Sequence[str]) -> None:
        if not group:
            raise InvalidArgument("group name must not be empty")
        if isinstance(topics, str):
            topics = [topics]
        self._bus = bus
        self._group = group
        tps = [TopicPartition(t, p) for t in topics for p in range(bus.topic(t).partitions)]
        committed = bus.committed(group, list(topics))
        self._positions = {
            tp: committed.get(tp, bus.watermarks(tp.topic, tp.partition)[0]) for tp in tps
        }
        self._order = tps
        self._next = 0
        self._closed = False
        self._generation = bus.arrival_generation  # as the last poll found the log

    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        if self._closed:
            raise BusClosed(f"the consumer of group {self._group!r} is closed")
        deadline = time.monotonic() + timeout
        while True:
            self._generation = generation = self._bus.arrival_generation
            out = self._read(max_records)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            self._bus.wait_for_arrivals(generation, left)

    async def arrivals(self, timeout: float) -> None:
        if self._closed:
            raise BusClosed(f"the consumer of group {self._group!r} is closed")
        await self._bus.arrivals(self._generation, timeout)

    def _read(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        n = len(self._order)
        for k in range(n):
            if len(out) >= max_records:
                break
            tp = self._order[(self._next + k) % n]
            try:
                records = self._bus.read(
                    tp.topic, tp.partition, self._positions[tp], max_records - len(out)
                )
            except OffsetOutOfRange:  # below the low watermark after retention: start there
                low, high = self._bus.watermarks(tp.topic, tp.partition)
                self._positions[tp] = low if self._positions[tp] < low else high
                continue
            if records:
                out += records
                self._positions[tp] = records[-1].offset + 1
        self._next = (self._next + 1) % max(n, 1)
        return out

    def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        self._bus.commit(self._group, dict(self._positions) if offsets is None else offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self._positions:
            raise UnknownPartition(f"{tp.topic}/{tp.partition} is not assigned to this consumer")
        self._positions[tp] = offset

    def assignment(self) -> list[TopicPartition]:
        return list(self._order)

    def close(self) -> None:
        self._closed = True
