"""The Kafka reader: the records of topics of an external Kafka cluster become ``insert``s on
the log.

- **Messages.** A record's namespace is its topic; ``data`` is its value when that is a JSON
  object, else ``{"value": <text>}`` (``{"value": <base64>, "encoding": "base64"}`` when the
  value is not UTF-8). ``key`` is ``{"key": <the record key as text>}`` (base64 and an
  ``encoding`` likewise) when the record has one. A null value with a key (a tombstone) becomes a
  ``delete`` of that key. The position is ``topic/partition/offset``.
- **Offsets.** The reader assigns itself every partition of its topics, from the offsets in its
  state file: the external cluster's group offsets are neither read nor committed. A partition it
  has no offset for yet starts at its first or its next record (``start``); that offset is saved
  at once, so a restart starts there too. New partitions and topics are looked for every
  ``METADATA_S``.
- **No loss, no duplicate.** Records are appended in durable batches of at most
  ``batch_records``; the offsets are saved once the batch is durable. A reader killed between
  the two finds, on start, the offsets of what it had appended in the last records of its
  topics, and resumes after them. A source partition's records all go to one partition of the
  topic, in order.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from headwater.bus.base import Bus
from headwater.bus.kafka.client import load_kafka
from headwater.errors import HeadwaterError
from headwater.transport.config import KafkaReaderConfig
from headwater.transport.message import Change, Mode, Op, now_ms, topic_name
from headwater.transport.reader import Reader, log_tail, wait_durable

log = logging.getLogger(__name__)
POLL_S = 0.5  # longest wait for records before the loop looks at stop and metadata again
METADATA_S = 10.0  # how often new partitions and topics are looked for
METADATA_IDLE_S = 1.0  # ... while the reader has none yet
TIMEOUT_S = 10.0  # requests to the cluster (metadata, watermarks)
RETRY_S = 1.0  # after a transient error

SourcePartition = tuple[str, int]


# -- records: pure functions ------------------------------------------------------------------


def text_or_base64(raw: bytes, name: str) -> dict[str, Any]:
    """``{name: <text>}``, or ``{name: <base64>, "encoding": "base64"}`` for bytes that are not
    UTF-8."""
    try:
        return {name: raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {name: base64.b64encode(raw).decode(), "encoding": "base64"}


def value_data(value: bytes) -> dict[str, Any]:
    """A record value as ``data``: the JSON object it holds, else the value as text."""
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError:
        body = None
    return body if isinstance(body, dict) else text_or_base64(value, "value")


def record_change(
    topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, ts_ms: int
) -> Change:
    """The change of one external record."""
    change = Change(
        Op.INSERT,
        topic,
        ts_ms,
        key=None if key is None else text_or_base64(key, "key"),
        position=f"{topic}/{partition}/{offset}",
    )
    if value is not None:
        change.data = value_data(value)
    elif key is not None:
        change.op = Op.DELETE
    else:
        change.data = {"value": None}
    return change


def parse_position(position: str | None) -> tuple[str, int, int] | None:
    """``topic/partition/offset`` -> its parts; None when it is not one."""
    parts = (position or "").rsplit("/", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def transient(error: BaseException) -> bool:
    """Whether retrying may help: the log's transient errors, and the client's errors that
    librdkafka calls retriable or that say the cluster is out of reach."""
    if isinstance(error, HeadwaterError):
        return error.transient
    kafka = load_kafka()
    if not isinstance(error, kafka.KafkaException) or not error.args:
        return False
    err = error.args[0]
    if not isinstance(err, kafka.KafkaError) or err.fatal():
        return False
    unreachable = {
        kafka.KafkaError._TRANSPORT,
        kafka.KafkaError._ALL_BROKERS_DOWN,
        kafka.KafkaError._TIMED_OUT,
        kafka.KafkaError._RESOLVE,
    }
    return bool(err.retriable()) or err.code() in unreachable


# -- the reader -------------------------------------------------------------------------------


class KafkaReader(Reader):
    """Reads topics of an external Kafka cluster onto the log."""

    config: KafkaReaderConfig

    def __init__(self, config: KafkaReaderConfig, bus: Bus, state_dir: Path) -> None:
        super().__init__(config, bus, state_dir)
        self._kafka: ModuleType | None = None
        self._next: dict[SourcePartition, int] = {}  # the next offset to read
        self._done: dict[SourcePartition, int] = {}  # ... of what the log holds durably
        self._assigned: set[SourcePartition] = set()
        self._missing: set[str] = set()  # topics said to be missing
        self.changes = 0  # appended by this process

    # -- run --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self._kafka = kafka = load_kafka()
        try:
            while not stop.is_set():
                consumer = kafka.Consumer(self._settings())
                try:
                    self._recover(consumer)
                    self._loop(consumer, stop)
                except Exception as e:
                    if not transient(e):
                        raise
                    log.warning(
                        "kafka reader %s: %s; reading again from the log's offsets in %.0f s",
                        self.config.id,
                        e,
                        RETRY_S,
                    )
                    self.report(force=True, error=str(e))
                    stop.wait(RETRY_S)
                finally:
                    consumer.close()
        finally:
            self.report(force=True, running=False)

    def _settings(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "bootstrap.servers": cfg.bootstrap_servers,
            "group.id": f"headwater-transport-{cfg.id}",  # required; never committed to
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": cfg.start,  # an offset the cluster no longer has
            **cfg.client,
        }

    def _loop(self, consumer: Any, stop: threading.Event) -> None:
        self.report(force=True, running=True, error=None)
        look_at = time.monotonic() + (METADATA_S if self._assigned else METADATA_IDLE_S)
        while not stop.is_set():
            if time.monotonic() >= look_at:
                self._assign(consumer)
                look_at = time.monotonic() + (METADATA_S if self._assigned else METADATA_IDLE_S)
            self._fill(consumer, stop)
            self._flush(stop)
            self._report(consumer)

    # -- offsets ----------------------------------------------------------------------------
    def _recover(self, consumer: Any) -> None:
        """Load the offsets, move them up to what the log already holds, assign the
        partitions."""
        state = self.load_state()
        self._done = {}
        for name, offset in state.get("offsets", {}).items():
            topic, _, partition = name.rpartition("/")
            self._done[(topic, int(partition))] = int(offset)
        window = max(self.config.batch_records, int(state.get("window", 0)))
        for topic in self.config.topics:
            self._recover_topic(topic, set(self._partitions(consumer, topic)), window)
        self._next = dict(self._done)
        self._assigned = set()
        self._assign(consumer, save=True)

    def _recover_topic(self, topic: str, partitions: set[int], window: int) -> None:
        """Catch up with the newest change of each partition of ``topic`` in its last records
        on the log."""
        left = set(partitions)
        for change in log_tail(
            self.bus, topic_name(self.config.topic, self.config.id, topic), window
        ):
            where = parse_position(change.position)
            if where is None or change.namespace != topic or where[0] != topic:
                continue
            sp = (topic, where[1])
            self._done[sp] = max(self._done.get(sp, 0), where[2] + 1)
            left.discard(where[1])
            if not left:
                return

    def _assign(self, consumer: Any, save: bool = False) -> None:
        """Assign the partitions not assigned yet, from their offsets; a partition without
        one starts where ``start`` says, saved at once."""
        assert self._kafka is not None
        new = []
        for topic in self.config.topics:
            for partition in self._partitions(consumer, topic):
                sp = (topic, partition)
                if sp in self._assigned:
                    continue
                if sp not in self._next:
                    self._next[sp] = self._done[sp] = self._first(consumer, topic, partition)
                    save = True
                new.append(self._kafka.TopicPartition(topic, partition, self._next[sp]))
        if new:
            consumer.incremental_assign(new)
            self._assigned.update((tp.topic, tp.partition) for tp in new)
        if save:
            self._save()

    def _partitions(self, consumer: Any, topic: str) -> list[int]:
        """The partitions of an external topic; none while it does not exist."""
        meta = consumer.list_topics(topic, timeout=TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None:
            if topic not in self._missing:
                reason = meta.error if meta is not None else "not in the cluster's metadata"
                log.warning("kafka reader %s: topic %s: %s", self.config.id, topic, reason)
                self._missing.add(topic)
            return []
        self._missing.discard(topic)
        return sorted(meta.partitions)

    def _first(self, consumer: Any, topic: str, partition: int) -> int:
        """Where a partition without an offset starts: its first record, or its next one."""
        assert self._kafka is not None
        tp = self._kafka.TopicPartition(topic, partition)
        marks = consumer.get_watermark_offsets(tp, timeout=TIMEOUT_S)
        if marks is None:
            raise self._kafka.KafkaException(
                self._kafka.KafkaError(self._kafka.KafkaError._TIMED_OUT)
            )
        low, high = marks
        return int(low if self.config.start == "earliest" else high)

    def _save(self) -> None:
        offsets = {f"{t}/{p}": o for (t, p), o in sorted(self._done.items())}
        self.save_state({"offsets": offsets, "window": self.config.batch_records})

    # -- reading ----------------------------------------------------------------------------
    def _fill(self, consumer: Any, stop: threading.Event) -> None:
        """Add records until the batch is full or has lingered ``linger_ms``; return at once
        when none came within ``POLL_S``."""
        limit = self.config.batch_records
        deadline: float | None = None
        while self.appender.count < limit and not stop.is_set():
            wait = POLL_S if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                return
            for message in consumer.consume(num_messages=limit - self.appender.count, timeout=wait):
                self._take(message)
            if deadline is None:
                if not self.appender.count:
                    return
                deadline = time.monotonic() + self.config.linger_ms / 1000

    def _take(self, message: Any) -> None:
        error = message.error()
        if error is not None:
            assert self._kafka is not None
            if error.fatal():
                raise self._kafka.KafkaException(error)
            log.warning("kafka reader %s: %s", self.config.id, error)
            return
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        sp = (topic, partition)
        if offset < self._next.get(sp, 0):
            return  # given again after a restart of the fetch: already added
        change = record_change(topic, partition, offset, message.key(), message.value(), now_ms())
        self.appender.add(change, Mode.SYNC, pin=f"{topic}/{partition}")
        self._next[sp] = offset + 1
        self.changes += 1

    def _flush(self, stop: threading.Event) -> None:
        """Append what is pending; once it is durable, save the offsets."""
        futures = self.appender.send()
        if futures and wait_durable(futures, stop):
            self._done = dict(self._next)
            self._save()

    # -- status -----------------------------------------------------------------------------
    def _report(self, consumer: Any) -> None:
        """Per topic: the next offset of each partition, and how far behind the cluster the
        reader is by the high watermarks of its last fetches."""
        for topic in self.config.topics:
            done = {p: o for (t, p), o in sorted(self._done.items()) if t == topic}
            lag = sum(self._lag(consumer, topic, p, o) for p, o in done.items())
            position = {str(p): o for p, o in done.items()}
            self.phase(topic, "sync", position=position, lag=lag)
        self.report(changes=self.changes, partitions=len(self._assigned))

    def _lag(self, consumer: Any, topic: str, partition: int, offset: int) -> int:
        """Records of an assigned partition not on the log yet (0 when not known)."""
        assert self._kafka is not None
        if (topic, partition) not in self._assigned:
            return 0
        try:
            _, high = consumer.get_watermark_offsets(
                self._kafka.TopicPartition(topic, partition), cached=True
            )
        except self._kafka.KafkaException:
            return 0
        return max(int(high) - offset, 0) if high >= 0 else 0
