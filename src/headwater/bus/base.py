"""The bus interface: one contract, two backends (``embedded`` and ``kafka``).

Offsets committed for a group follow Kafka's meaning: the offset of the *next* record to read.
``append`` returns a future that resolves once the batch is durable under the backend's policy
(the embedded log's durability setting; ``acks=all`` on Kafka), with one ``Position`` per message
in the order given. When the backend's write queue is full, ``append`` and ``append_many`` raise
``QueueFull`` having queued nothing; ``headwater.bus.waiting`` appends waiting for room instead.

Rules every backend keeps (the contract suite in ``tests/bus/test_contract.py`` checks them):

- A bus opened ``read_only`` refuses ``create_topic``, ``append`` and ``commit``.
- ``commit`` refuses an offset outside ``[low, high]`` of its partition (``InvalidArgument``).
- Values and header values are bytes; Kafka's null values read back as ``b""``. A message
  timestamp of 0 means "now" on Kafka (librdkafka's rule), so use timestamps after the epoch.
- Group offsets committed on the embedded log are seen by another process once persisted (every
  ``offsets_flush_interval_ms`` and on close).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from operator import attrgetter
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self

from headwater.bus.errors import QueueFull
from headwater.bus.records import (
    CompactionResult,
    Message,
    Position,
    Record,
    TopicInfo,
    TopicPartition,
)

if TYPE_CHECKING:
    import pyarrow as pa

ARROW_MAX_RECORDS = 65_536


class Closing(ABC):
    """A resource that ``close`` releases, usable in a ``with`` block that closes it (the bus, its
    consumers, the destinations)."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Consumer(Closing):
    """Reads the partitions of some topics for one group, from its committed offsets."""

    # ``poll(n, 0)`` and ``commit`` answer at once (no network, no waiting on a lock held across
    # I/O): an event loop may call them in place rather than on a thread of its own, and wait
    # for records with ``arrivals``
    polls_in_place: ClassVar[bool] = False

    async def arrivals(self, timeout: float) -> None:
        """On the running loop, wait until records may have arrived since the last ``poll``
        found none, at most ``timeout`` seconds (then poll in place again). Only consumers that
        ``polls_in_place`` have it."""
        raise NotImplementedError(f"{type(self).__name__} does not wait on an event loop")

    @abstractmethod
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records; waits at most ``timeout`` seconds when none are ready."""

    @abstractmethod
    def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (next offset to read), or the position after everything polled."""

    @abstractmethod
    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` on the next poll. On Kafka a seek on a partition the group
        has not assigned yet applies once it is assigned; the embedded consumer owns every
        partition from the start and raises ``UnknownPartition`` for one it does not read."""

    @abstractmethod
    def assignment(self) -> list[TopicPartition]:
        """The partitions this consumer currently reads (on Kafka: empty until the group has
        assigned them during a poll)."""


class Bus(Closing):
    """The log between the collector and the pipeline."""

    backend: ClassVar[str]

    # -- topics ---------------------------------------------------------------------------
    @abstractmethod
    def create_topic(
        self, name: str, partitions: int | None = None, replication_factor: int | None = None
    ) -> TopicInfo:
        """Create ``name`` (defaults from config); return the existing topic if it exists."""

    @abstractmethod
    def topics(self) -> list[TopicInfo]:
        """Every topic, sorted by name (internal topics excluded)."""

    @abstractmethod
    def topic(self, name: str) -> TopicInfo:
        """One topic; raises ``UnknownTopic``."""

    # -- writing --------------------------------------------------------------------------
    @abstractmethod
    def append(self, topic: str, messages: Sequence[Message]) -> Future[Sequence[Position]]:
        """Append a batch. Validation errors raise at once; I/O errors fail the future."""

    def append_many(
        self, batches: Mapping[str, Sequence[Message]]
    ) -> list[Future[Sequence[Position]]]:
        """Append one batch per topic, all validated before any is appended. The embedded log
        also queues them all or none, so a full queue never stores part of them."""
        return [self.append(topic, messages) for topic, messages in batches.items()]

    def wait_for_room(self, refused: QueueFull, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the write queue that refused an append with
        ``refused`` could take it; whether it could. Use ``headwater.bus.waiting`` rather than
        calling this. This default flushes (a queue frees as what it holds is made durable)."""
        self.flush(timeout)
        return True

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Block until everything appended so far is durable."""

    # -- reading --------------------------------------------------------------------------
    @abstractmethod
    def read(
        self,
        topic: str,
        partition: int,
        offset: int,
        max_records: int = 1000,
        max_bytes: int | None = None,
    ) -> list[Record]:
        """Records from ``offset`` (or the next one after it, where compaction removed it) up to
        the high watermark. Raises ``OffsetOutOfRange`` below the low or above the high
        watermark. ``max_bytes`` is a soft limit: at least one record is returned, and a backend
        may round up to whole stored batches."""

    def read_arrow(
        self,
        topic: str,
        partition: int,
        offset: int,
        end: int | None = None,
        max_records: int = ARROW_MAX_RECORDS,
    ) -> list[pa.RecordBatch]:
        """The records ``[offset, end)`` (``end`` None: up to the high watermark), at most
        ``max_records``, as Arrow batches in the layout of Spark's Kafka source
        (``headwater.bus.arrow.ARROW_SCHEMA``); no batch is empty, and the list is empty when
        the range holds no record (yet). Offsets and errors as ``read``; a short answer is not
        the end of the range: read on from its last offset + 1. This default builds one batch
        from ``read``'s records; a backend that stores columns (the embedded log) decodes them
        without a Python object per record."""
        from headwater.bus.arrow import to_record_batch

        if end is not None:
            max_records = min(max_records, max(end - offset, 1))
        records = self.read(topic, partition, offset, max_records=max_records)
        if end is not None:
            records = records[: bisect_left(records, end, key=attrgetter("offset"))]
        return [to_record_batch(records)] if records else []

    @abstractmethod
    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        """(low, high): the first readable offset and the offset the next record will get."""

    # -- groups (writers) -----------------------------------------------------------------
    @abstractmethod
    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        """Set a group's committed offsets (next offset to read) for some partitions."""

    @abstractmethod
    def committed(
        self, group: str, topics: Sequence[str] | None = None
    ) -> dict[TopicPartition, int]:
        """A group's committed offsets, for every partition it has committed."""

    @abstractmethod
    def groups(self) -> list[str]:
        """Every group that has committed offsets, sorted (Kafka also lists groups that have
        members but no commits yet)."""

    @abstractmethod
    def consumer(self, group: str, topics: Sequence[str]) -> Consumer:
        """A consumer for ``group`` over ``topics``, starting at the committed offsets (or the
        low watermark where the group has none)."""

    # -- maintenance ----------------------------------------------------------------------
    @abstractmethod
    def compact(self, topic: str | None = None) -> list[CompactionResult]:
        """Compact closed segments (embedded) or report what the broker does (kafka)."""

    @abstractmethod
    def close(self) -> None:
        """Flush, persist group offsets and release resources. Idempotent."""
