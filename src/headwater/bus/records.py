"""The records the bus carries. Both backends produce and accept exactly these."""

from __future__ import annotations

from typing import NamedTuple

Header = tuple[str, bytes]
Headers = tuple[Header, ...]


class Message(NamedTuple):
    """One record to append. ``timestamp`` is milliseconds since the epoch (default: now);
    ``partition`` overrides keyed partitioning."""

    value: bytes
    key: bytes | None = None
    headers: Headers = ()
    timestamp: int | None = None
    partition: int | None = None


class Record(NamedTuple):
    """One record read back from the log: the same layout as a Kafka record."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes
    headers: Headers


class Position(NamedTuple):
    """Where an appended message landed."""

    partition: int
    offset: int


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class TopicInfo(NamedTuple):
    name: str
    partitions: int
    replication_factor: int = 1


class CompactionResult(NamedTuple):
    topic: str
    partition: int
    segments: int
    records_before: int
    records_after: int
    bytes_before: int
    bytes_after: int
