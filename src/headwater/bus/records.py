"""The records the bus carries. Both backends produce and accept exactly these."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

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


class PositionRun(Sequence[Position]):
    """The positions of ``count`` messages appended to one partition from ``base`` on: a
    sequence built in O(1), since a batch's offsets are contiguous."""

    __slots__ = ("_base", "_count", "_partition")

    def __init__(self, partition: int, base: int, count: int) -> None:
        self._partition = partition
        self._base = base
        self._count = count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> Position: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Position]: ...
    def __getitem__(self, i: int | slice) -> Position | Sequence[Position]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(i)
        return Position(self._partition, self._base + i)

    def __iter__(self) -> Iterator[Position]:
        p = self._partition
        return (Position(p, o) for o in range(self._base, self._base + self._count))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._partition, self._base, self._count))

    def __repr__(self) -> str:
        last = self._base + self._count - 1
        return f"PositionRun(partition={self._partition}, offsets={self._base}..{last})"


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
