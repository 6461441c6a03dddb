"""The Kafka backend of the bus (``bus.backend: kafka``).

Appends are produced with ``acks=all`` and idempotence, so an append's future resolves only once
every in-sync replica has the batch, and retries never duplicate or reorder records. They go
through headwater's own producer (``bus.kafka.sender``, on a thread of its own:
``bus.kafka.threaded``), or, with ``producer_client: librdkafka``, through confluent-kafka's
(``bus.kafka.producer``); reading, groups and admin are confluent-kafka's. headwater
chooses the partition itself (CRC-32 of the key, as the embedded log does), so a key lands on the
same partition number on both backends. ``read`` and ``watermarks`` use a consumer with assigned
partitions that never joins a group; group offsets are read and set through the admin API.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from headwater.bus.base import Bus, Consumer
from headwater.bus.errors import (
    BusClosed,
    BusUnavailable,
    InvalidArgument,
    OffsetOutOfRange,
    QueueFull,
    TopicExists,
    UnknownPartition,
    UnknownTopic,
)
from headwater.bus.kafka.client import (
    admin_settings,
    consumer_settings,
    load_admin,
    load_kafka,
    producer_settings,
    reader_settings,
    topic_settings,
)
from headwater.bus.kafka.config import KafkaBusConfig
from headwater.bus.kafka.consumer import PARTITION_EOF, KafkaConsumer, record_size, to_record
from headwater.bus.kafka.errors import classify
from headwater.bus.kafka.producer import DeliveryProducer, Send
from headwater.bus.kafka.threaded import ThreadedSender
from headwater.bus.names import check_topic_name
from headwater.bus.partitioner import Partitioner
from headwater.bus.records import CompactionResult, Message, Position, Record, TopicInfo
from headwater.bus.records import TopicPartition as TP
from headwater.bus.validation import validate_batch

if TYPE_CHECKING:
    from headwater.config.model import HeadwaterConfig

# How long a topic's partition count is trusted before the cluster is asked again.
_PARTITIONS_TTL_S = 30.0


class KafkaBus(Bus):
    """The bus on a Kafka cluster."""

    backend: ClassVar[str] = "kafka"

    def __init__(self, config: KafkaBusConfig, *, read_only: bool = False) -> None:
        self._admin_module = load_admin()
        self._kafka = load_kafka()
        self._config = config
        self._timeout = config.timeout_s
        self._read_only = read_only
        self._admin = self._admin_module.AdminClient(admin_settings(config))
        self._partitioner = Partitioner()
        self._lock = threading.Lock()
        self._reader_lock = threading.Lock()
        self._producer: DeliveryProducer | ThreadedSender | None = None
        self._reader: Any = None
        self._partitions: dict[str, tuple[int, float]] = {}
        self._consumers: set[KafkaConsumer] = set()
        self._closed = False

    @classmethod
    def from_config(cls, config: HeadwaterConfig, *, read_only: bool = False) -> KafkaBus:
        """The bus of ``config.bus.kafka``. ``read_only`` refuses creating topics, appending and
        committing (Kafka has no lock to skip)."""
        return cls(config.bus.kafka, read_only=read_only)

    @property
    def config(self) -> KafkaBusConfig:
        return self._config

    # -- topics ---------------------------------------------------------------------------
    def create_topic(
        self, name: str, partitions: int | None = None, replication_factor: int | None = None
    ) -> TopicInfo:
        """Create ``name``; an existing topic is returned as it is, whatever its partitions."""
        self._check_writable()
        check_topic_name(name)
        partitions = self._config.default_partitions if partitions is None else partitions
        replicas = (
            self._config.replication_factor if replication_factor is None else replication_factor
        )
        if partitions < 1 or replicas < 1:
            raise InvalidArgument(
                f"topic {name!r} needs at least 1 partition and 1 replica "
                f"(got partitions={partitions}, replication_factor={replicas})"
            )
        new_topic = self._admin_module.NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=replicas,
            config=topic_settings(self._config),
        )
        futures = self._admin.create_topics(
            [new_topic], request_timeout=self._timeout, operation_timeout=self._timeout
        )
        try:
            futures[name].result(timeout=self._timeout)
        except Exception as exc:
            error = classify(exc, f"creating topic {name!r}")
            if not isinstance(error, TopicExists):
                raise error from exc
        return self._await_topic(name)

    def topics(self) -> list[TopicInfo]:
        infos = (
            self._info(t) for t in self._metadata().topics.values() if not t.topic.startswith("__")
        )
        return sorted((i for i in infos if i is not None), key=lambda i: i.name)

    def topic(self, name: str) -> TopicInfo:
        check_topic_name(name)
        # Ask for every topic: some brokers create a topic that a metadata request names.
        info = self._info(self._metadata().topics.get(name))
        if info is None:
            raise UnknownTopic(f"topic {name!r} does not exist")
        self._partitions[name] = (info.partitions, time.monotonic() + _PARTITIONS_TTL_S)
        return info

    # -- writing --------------------------------------------------------------------------
    def append(self, topic: str, messages: Sequence[Message]) -> Future[Sequence[Position]]:
        return self.append_many({topic: messages})[0]

    def append_many(
        self, batches: Mapping[str, Sequence[Message]]
    ) -> list[Future[Sequence[Position]]]:
        """Validate every batch, then hand them all to the producer, or none when its queue
        cannot take them all (``QueueFull``)."""
        self._check_writable()
        for topic, messages in batches.items():
            check_topic_name(topic)
            validate_batch(topic, messages, self._config.max_record_bytes)
        sends: list[Send] = []
        for topic, messages in batches.items():
            partitions = self._partition_count(topic, create=self._config.auto_create_topics)
            sends.append((topic, messages, self._partitioner.split(topic, partitions, messages)))
        return self._delivery().send_all(sends)

    def partitions_for_append(self, topic: str) -> int:
        """How many partitions ``topic`` has, creating it as an append would."""
        self._check_writable()
        return self._partition_count(topic, create=self._config.auto_create_topics)

    def wait_for_room(self, refused: QueueFull, timeout: float) -> bool:
        return self._delivery().wait_for_room(refused.needed, timeout)

    def flush(self, timeout: float | None = None) -> None:
        self._check_open()
        producer = self._producer
        if producer is not None:
            producer.flush(timeout)

    # -- reading --------------------------------------------------------------------------
    def read(
        self,
        topic: str,
        partition: int,
        offset: int,
        max_records: int = 1000,
        max_bytes: int | None = None,
    ) -> list[Record]:
        """Records from ``offset`` up to the end of the partition; with ``max_bytes``, the first
        record is returned even when it alone is larger (as Kafka does)."""
        if max_records < 1:
            raise InvalidArgument(f"max_records must be at least 1, not {max_records}")
        low, high = self.watermarks(topic, partition)
        if not low <= offset <= high:
            raise OffsetOutOfRange(
                f"offset {offset} of {topic}[{partition}] is outside the log ({low} to {high})"
            )
        with self._reader_lock:
            reader = self._reader_client()
            reader.assign([self._kafka.TopicPartition(topic, partition, offset)])
            try:
                return self._read_assigned(reader, topic, partition, offset, max_records, max_bytes)
            finally:
                reader.unassign()

    def _read_assigned(
        self,
        reader: Any,
        topic: str,
        partition: int,
        offset: int,
        max_records: int,
        max_bytes: int | None,
    ) -> list[Record]:
        action = f"reading {topic}[{partition}] from offset {offset}"
        records: list[Record] = []
        size = 0
        deadline = time.monotonic() + self._timeout
        while (remaining := deadline - time.monotonic()) > 0:
            first = reader.poll(remaining)
            if first is None:
                continue
            for message in [first, *reader.consume(max_records - len(records), 0)]:
                error = message.error()
                if error is not None:
                    if error.name() == PARTITION_EOF:
                        return records
                    failure = classify(error, action)
                    if not failure.transient:
                        raise failure
                    continue
                if message.offset() < offset:
                    continue
                record = to_record(message)
                size += record_size(record)
                if records and max_bytes is not None and size > max_bytes:
                    return records
                records.append(record)
                if len(records) >= max_records:
                    return records
        if records:
            return records
        raise BusUnavailable(f"{action}: no answer within {self._timeout:.0f} s")

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        self._check_partition(topic, partition)
        deadline = time.monotonic() + self._timeout
        pause = 0.05
        with self._reader_lock:
            reader = self._reader_client()
            tp = self._kafka.TopicPartition(topic, partition)
            while True:
                left = deadline - time.monotonic()
                try:
                    marks = reader.get_watermark_offsets(tp, timeout=max(left, 0.1), cached=False)
                    break
                except Exception as exc:
                    error = classify(exc, f"reading the watermarks of {topic}[{partition}]")
                    # a partition's leader moves (or is not yet known after the topic was
                    # made): asked again until the deadline, as the producer and consumer do
                    if not isinstance(error, BusUnavailable) or left <= pause:
                        raise error from exc
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
        if marks is None:
            raise BusUnavailable(f"the watermarks of {topic}[{partition}] are not available")
        low, high = marks
        return int(low), int(high)

    # -- groups (writers) -----------------------------------------------------------------
    def commit(self, group: str, offsets: Mapping[TP, int]) -> None:
        """Set ``group``'s offsets, each within the log's watermarks. Kafka refuses this while
        the group has active members."""
        self._check_writable()
        self._check_group(group)
        if not offsets:
            return
        for (topic, partition), offset in offsets.items():
            low, high = self.watermarks(topic, partition)
            if not low <= offset <= high:
                raise InvalidArgument(
                    f"offset {offset} for {topic}[{partition}] is outside the log ({low} to {high})"
                )
        request = self._kafka.ConsumerGroupTopicPartitions(
            group, [self._kafka.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        )
        action = f"committing offsets of group {group!r}"
        futures = self._admin.alter_consumer_group_offsets([request], request_timeout=self._timeout)
        try:
            result = futures[group].result(timeout=self._timeout)
        except Exception as exc:
            raise classify(exc, action) from exc
        for tp in result.topic_partitions:
            if tp.error is not None:
                raise classify(tp.error, f"{action} ({tp.topic}[{tp.partition}])")

    def committed(self, group: str, topics: Sequence[str] | None = None) -> dict[TP, int]:
        self._check_group(group)
        self._check_open()
        request = self._kafka.ConsumerGroupTopicPartitions(group)
        futures = self._admin.list_consumer_group_offsets([request], request_timeout=self._timeout)
        try:
            result = futures[group].result(timeout=self._timeout)
        except Exception as exc:
            if _error_name(exc) == "GROUP_ID_NOT_FOUND":
                return {}
            raise classify(exc, f"reading the offsets of group {group!r}") from exc
        wanted = None if topics is None else set(topics)
        found = {
            TP(tp.topic, tp.partition): tp.offset
            for tp in result.topic_partitions or ()
            if tp.error is None and tp.offset >= 0 and (wanted is None or tp.topic in wanted)
        }
        return dict(sorted(found.items()))

    def groups(self) -> list[str]:
        self._check_open()
        future = self._admin.list_consumer_groups(request_timeout=self._timeout)
        try:
            result = future.result(timeout=self._timeout)
        except Exception as exc:
            raise classify(exc, "listing consumer groups") from exc
        if result.errors:
            raise classify(result.errors[0], "listing consumer groups")
        return sorted(g.group_id for g in result.valid)

    def consumer(self, group: str, topics: Sequence[str]) -> Consumer:
        """A member of ``group`` (partitions are assigned by the group, during ``poll``)."""
        self._check_group(group)
        for topic in topics:
            self._partition_count(topic, create=False)
        with self._lock:
            self._check_open()
            consumer = KafkaConsumer(
                consumer_settings(self._config, group), topics, on_close=self._consumers.discard
            )
            self._consumers.add(consumer)
        return consumer

    # -- maintenance ----------------------------------------------------------------------
    def compact(self, topic: str | None = None) -> list[CompactionResult]:
        """Nothing to do here: on Kafka the brokers compact topics whose ``cleanup.policy`` is
        ``compact``, in the background. Returns ``[]`` (after checking that ``topic`` exists)."""
        if topic is not None:
            self.topic(topic)
        return []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._consumers = list(self._consumers), set()
        for consumer in consumers:
            consumer.close()
        if self._producer is not None:
            self._producer.close(self._timeout)
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    # -- helpers --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("the Kafka bus is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            raise InvalidArgument("the Kafka bus was opened read-only")

    def _check_group(self, group: str) -> None:
        if not isinstance(group, str) or not group:
            raise InvalidArgument("a group name must be a non-empty string")

    def _check_partition(self, topic: str, partition: int) -> None:
        partitions = self._partition_count(topic, create=False)
        if not 0 <= partition < partitions:
            raise UnknownPartition(
                f"topic {topic!r} has no partition {partition} (it has {partitions})"
            )

    def _partition_count(self, topic: str, *, create: bool) -> int:
        self._check_open()
        cached = self._partitions.get(topic)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        try:
            return self.topic(topic).partitions
        except UnknownTopic:
            if not create:
                raise
        return self.create_topic(topic).partitions

    def _metadata(self) -> Any:
        self._check_open()
        try:
            return self._admin.list_topics(timeout=self._timeout)
        except Exception as exc:
            raise classify(exc, "reading the cluster metadata") from exc

    def _info(self, metadata: Any) -> TopicInfo | None:
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return None
        replicas = len(metadata.partitions[0].replicas) or 1
        return TopicInfo(metadata.topic, len(metadata.partitions), replicas)

    def _await_topic(self, name: str) -> TopicInfo:
        """The topic once the cluster's metadata shows it with a leader for every partition
        (creation propagates to brokers, then each partition elects its leader: a read before
        that is refused with NOT_LEADER_FOR_PARTITION)."""
        deadline = time.monotonic() + self._timeout
        delay = 0.01
        while True:
            found = self._metadata().topics.get(name)
            info = self._info(found)
            if info is not None and all(
                p.error is None and p.leader >= 0 for p in found.partitions.values()
            ):
                return self.topic(name)
            if time.monotonic() + delay > deadline:
                what = (
                    "is not in the metadata" if info is None else "has a partition with no leader"
                )
                raise BusUnavailable(
                    f"topic {name!r} was created but {what} after {self._timeout:.0f} s"
                )
            time.sleep(delay)  # back off between metadata requests, bounded by the deadline
            delay = min(delay * 2, 0.5)

    def _delivery(self) -> DeliveryProducer | ThreadedSender:
        with self._lock:
            self._check_open()
            broken = self._producer
            if broken is not None and broken.fatal_error is not None:
                self._producer = None
                broken.close(0)  # its messages have failed already; start a fresh producer
            if self._producer is None:
                if self._config.own_producer:
                    self._producer = ThreadedSender(self._config, f"headwater-{os.getpid()}")
                else:
                    settings = producer_settings(self._config)
                    self._producer = DeliveryProducer(settings, self._timeout)
            return self._producer

    def _reader_client(self) -> Any:
        if self._reader is None:
            self._check_open()
            self._reader = self._kafka.Consumer(reader_settings(self._config))
        return self._reader


def _error_name(exc: BaseException) -> str | None:
    error = exc.args[0] if exc.args else None
    name = getattr(error, "name", None)
    return str(name()) if callable(name) else None
