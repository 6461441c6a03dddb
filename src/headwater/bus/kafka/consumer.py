"""Reading from Kafka: the record conversion and the group consumer with manual commits."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from headwater.bus.base import Consumer
from headwater.bus.errors import BusClosed
from headwater.bus.kafka.client import load_kafka
from headwater.bus.kafka.errors import classify
from headwater.bus.records import Record, TopicPartition
from headwater.errors import HeadwaterError

PARTITION_EOF = "_PARTITION_EOF"


def to_record(message: Any) -> Record:
    """A bus record from a confluent-kafka message. Null values and header values (which
    headwater never writes) read back as empty bytes."""
    headers = message.headers()
    return Record(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        timestamp=message.timestamp()[1],
        key=message.key(),
        value=message.value() or b"",
        headers=tuple((name, value or b"") for name, value in headers) if headers else (),
    )


def record_size(record: Record) -> int:
    return (
        len(record.value)
        + len(record.key or b"")
        + sum(len(name.encode()) + len(value) for name, value in record.headers)
    )


class KafkaConsumer(Consumer):
    """A member of a Kafka consumer group that commits only when told to.

    Partitions are assigned by the group (subscribe), so several consumers of one group share
    the partitions. ``assignment()`` is empty until the group has assigned partitions, which
    happens during ``poll``.
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        topics: Sequence[str],
        on_close: Callable[[KafkaConsumer], None] | None = None,
    ) -> None:
        self._kafka = load_kafka()
        self._consumer = self._kafka.Consumer(dict(settings))
        self._group = str(settings["group.id"])
        strategy = str(settings.get("partition.assignment.strategy", ""))
        self._cooperative = "cooperative" in strategy
        self._lock = threading.RLock()
        self._positions: dict[TopicPartition, int] = {}
        self._pending_seeks: dict[TopicPartition, int] = {}
        self._deferred: HeadwaterError | None = None
        self._on_close = on_close
        self._closed = False
        self._consumer.subscribe(
            list(topics), on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
        )

    # librdkafka calls these from inside poll(), on the polling thread.
    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        seeked = False
        for tp in partitions:
            key = TopicPartition(tp.topic, tp.partition)
            offset = self._pending_seeks.pop(key, None)
            if offset is not None:
                tp.offset = offset
                self._positions[key] = offset
                seeked = True
        if seeked:  # assign ourselves, with the offsets set above (else the client assigns)
            if self._cooperative:
                consumer.incremental_assign(partitions)
            else:
                consumer.assign(partitions)

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        for tp in partitions:
            self._positions.pop(TopicPartition(tp.topic, tp.partition), None)

    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        with self._lock:
            self._check_open()
            if self._deferred is not None:
                error, self._deferred = self._deferred, None
                raise error
            first = self._consumer.poll(timeout)
            if first is None:
                return []
            messages = [first]
            if max_records > 1:
                messages += self._consumer.consume(max_records - 1, 0)
            records: list[Record] = []
            for message in messages:
                error = message.error()
                if error is None:
                    record = to_record(message)
                    records.append(record)
                    self._positions[TopicPartition(record.topic, record.partition)] = (
                        record.offset + 1
                    )
                elif error.name() != PARTITION_EOF:
                    failure = classify(error, f"consuming for group {self._group!r}")
                    # librdkafka retries transient errors itself; it only reports them.
                    if not failure.transient and self._deferred is None:
                        self._deferred = failure
            if not records and self._deferred is not None:
                error, self._deferred = self._deferred, None
                raise error
            return records

    def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        with self._lock:
            self._check_open()
            chosen = dict(self._positions) if offsets is None else dict(offsets)
            if not chosen:
                return
            request = [self._kafka.TopicPartition(t, p, o) for (t, p), o in chosen.items()]
            action = f"committing offsets of group {self._group!r}"
            try:
                result = self._consumer.commit(offsets=request, asynchronous=False)
            except Exception as exc:
                raise classify(exc, action) from exc
            for tp in result or ():
                if tp.error is not None:
                    raise classify(tp.error, f"{action} ({tp.topic}[{tp.partition}])")

    def seek(self, tp: TopicPartition, offset: int) -> None:
        with self._lock:
            self._check_open()
            if tp in self.assignment():
                try:
                    self._consumer.seek(self._kafka.TopicPartition(tp.topic, tp.partition, offset))
                except Exception as exc:
                    raise classify(exc, f"seeking {tp.topic}[{tp.partition}]") from exc
                self._positions[tp] = offset
            else:  # applied once the group assigns the partition to this consumer
                self._pending_seeks[tp] = offset

    def assignment(self) -> list[TopicPartition]:
        with self._lock:
            self._check_open()
            return sorted(
                TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._consumer.close()
            finally:
                if self._on_close is not None:
                    self._on_close(self)

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed(f"the consumer of group {self._group!r} is closed")
