"""The embedded commit log: topics of partitions of segment files under one directory.

Layout::

    <dir>/LOCK                          held by the one writing process (flock)
    <dir>/CLEAN                         present only after a clean close
    <dir>/groups.json                   committed offsets of every group
    <dir>/topics/<topic>/topic.json     {"partitions": N}
    <dir>/topics/<topic>/<p>/<base>.log and <base>.index
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Self

from headwater.bus.base import ARROW_MAX_RECORDS, Bus, Consumer
from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.compaction import compact_partition
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.embedded.consumer import EmbeddedConsumer
from headwater.bus.embedded.lock import DirectoryLock
from headwater.bus.embedded.offsets import GroupOffsets
from headwater.bus.embedded.partition import Partition, now_ms
from headwater.bus.embedded.writer import Done, LogWriter, Parts
from headwater.bus.errors import (
    BusClosed,
    InvalidArgument,
    QueueFull,
    UnknownPartition,
    UnknownTopic,
)
from headwater.bus.names import check_topic_name
from headwater.bus.partitioner import Partitioner
from headwater.bus.records import (
    CompactionResult,
    Message,
    Position,
    PositionRun,
    Record,
    TopicInfo,
    TopicPartition,
)
from headwater.bus.validation import validate_batch

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.config.model import HeadwaterConfig

log = logging.getLogger(__name__)

_END = 1 << 62  # read_arrow's end when none is given: past any offset


class EmbeddedBus(Bus):
    backend = "embedded"

    def __init__(
        self, directory: Path, config: EmbeddedBusConfig | None = None, *, read_only: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.config = config or EmbeddedBusConfig()
        self.read_only = read_only
        self._topics: dict[str, list[Partition]] = {}
        self._topics_lock = threading.Lock()
        self._partitioner = Partitioner()
        self._closed = False
        self._arrivals = threading.Condition()
        self.arrival_generation = 0
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._lock: DirectoryLock | None = None
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = DirectoryLock(self.directory / "LOCK")
            self._lock.acquire()
        try:
            clean_marker = self.directory / "CLEAN"
            self._clean = clean_marker.exists() or read_only
            if not read_only:
                clean_marker.unlink(missing_ok=True)
            self._load_topics()
            self._offsets = GroupOffsets(
                self.directory / "groups.json",
                self.config.offsets_flush_interval_ms / 1000,
                writable=not read_only,
            )
            self._writer = LogWriter(
                self.config.durability,
                self.config.flush_interval_ms / 1000,
                self.config.max_pending_bytes,
                self._notify_arrivals,
            )
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        self._stop_maintenance = threading.Event()
        retention = self.config.retention
        if not read_only and (retention.bytes is not None or retention.ms is not None):
            threading.Thread(
                target=self._maintain,
                args=(retention.check_interval_ms / 1000,),
                name="headwater-log-retention",
                daemon=True,
            ).start()

    @classmethod
    def from_config(cls, config: HeadwaterConfig, *, read_only: bool = False) -> Self:
        return cls(config.log_dir(), config.bus.embedded, read_only=read_only)

    # -- topics ---------------------------------------------------------------------------
    def _load_topics(self) -> None:
        root = self.directory / "topics"
        if not root.is_dir():
            return
        for meta in sorted(root.glob("*/topic.json")):
            name = meta.parent.name
            if name not in self._topics:
                self._open_topic(name, json.loads(meta.read_bytes())["partitions"])

    def _open_topic(self, name: str, partitions: int) -> list[Partition]:
        parts = [
            Partition(
                name,
                i,
                self.directory / "topics" / name / str(i),
                self.config,
                writable=not self.read_only,
            )
            for i in range(partitions)
        ]
        for p in parts:
            p.open(clean=self._clean)
        self._topics[name] = parts
        return parts

    def create_topic(
        self, name: str, partitions: int | None = None, replication_factor: int | None = None
    ) -> TopicInfo:
        check_topic_name(name)
        self._check_writable()
        if partitions is not None and partitions < 1:
            raise InvalidArgument(f"a topic needs at least 1 partition, not {partitions}")
        if replication_factor not in (None, 1):
            raise InvalidArgument(
                f"the embedded log keeps one copy; replication factor {replication_factor} "
                "needs the kafka backend"
            )
        with self._topics_lock:
            existing = self._topics.get(name)
            if existing is not None:
                return TopicInfo(name, len(existing))
            count = partitions or self.config.default_partitions
            topic_dir = self.directory / "topics" / name
            topic_dir.mkdir(parents=True, exist_ok=True)
            tmp = topic_dir / "topic.json.tmp"
            tmp.write_text(json.dumps({"partitions": count}))
            tmp.replace(topic_dir / "topic.json")
            self._open_topic(name, count)
            return TopicInfo(name, count)

    def topics(self) -> list[TopicInfo]:
        self._check_open()
        if self.read_only:
            with self._topics_lock:
                self._load_topics()
        return [TopicInfo(n, len(p)) for n, p in sorted(self._topics.items())]

    def topic(self, name: str) -> TopicInfo:
        return TopicInfo(name, len(self._partitions(name)))

    def _partitions(self, topic: str) -> list[Partition]:
        self._check_open()
        parts = self._topics.get(topic)
        if parts is None and self.read_only:
            with self._topics_lock:
                self._load_topics()
            parts = self._topics.get(topic)
        if parts is None:
            check_topic_name(topic)
            raise UnknownTopic(f"topic {topic!r} does not exist")
        return parts

    def _partition(self, topic: str, partition: int) -> Partition:
        parts = self._partitions(topic)
        if not 0 <= partition < len(parts):
            raise UnknownPartition(
                f"topic {topic!r} has no partition {partition} (it has {len(parts)})"
            )
        return parts[partition]

    # -- writing --------------------------------------------------------------------------
    def append(self, topic: str, messages: Sequence[Message]) -> Future[Sequence[Position]]:
        future, items = self._prepare(topic, messages)
        if items:
            self._writer.submit(items)
        return future

    def append_many(
        self, batches: Mapping[str, Sequence[Message]]
    ) -> list[Future[Sequence[Position]]]:
        prepared = [self._prepare(topic, messages) for topic, messages in batches.items()]
        self._writer.submit([item for _, items in prepared for item in items])
        return [future for future, _ in prepared]

    def append_encoded(
        self, batches: Sequence[tuple[str, int | None, fmt.EncodedBatch, Done]]
    ) -> None:
        """Queue batches another process already encoded in the log's format (the collector's
        intake workers), all or none: ``(topic, partition or None for the next in turn,
        batch, done)``. Each ``done`` is called once its batch is durable, or failed."""
        items = []
        for topic, partition, batch, done in batches:
            parts = self._writable_partitions(topic)
            if partition is None:
                partition = self._partitioner.next_unkeyed(len(parts))
            elif not 0 <= partition < len(parts):
                raise UnknownPartition(
                    f"topic {topic!r} has no partition {partition} (it has {len(parts)})"
                )
            items.append((parts[partition], batch, done))
        self._writer.submit(items)

    def partitions_for_append(self, topic: str) -> int:
        """How many partitions ``topic`` has, creating it as an append would."""
        return len(self._writable_partitions(topic))

    def _writable_partitions(self, topic: str) -> list[Partition]:
        """The partitions of a topic to append to, created first when the config allows."""
        self._check_writable()
        parts = self._topics.get(topic)
        if parts is None:
            if not self.config.auto_create_topics:
                check_topic_name(topic)
                raise UnknownTopic(
                    f"topic {topic!r} does not exist and bus.embedded.auto_create_topics is off"
                )
            parts = self._partitions(self.create_topic(topic).name)
        return parts

    def _prepare(
        self, topic: str, messages: Sequence[Message]
    ) -> tuple[Future[Sequence[Position]], list[tuple[Partition, fmt.EncodedBatch, Done]]]:
        """Validate and encode a batch: its future and what to queue for the writer."""
        parts = self._writable_partitions(topic)
        validate_batch(topic, messages, self.config.max_record_bytes)
        future: Future[Sequence[Position]] = Future()
        if not messages:
            future.set_result([])
            return future, []
        groups = self._partitioner.split(topic, len(parts), messages)
        stamp = now_ms()
        if len(groups) == 1:
            ((p, _),) = groups.items()
            return future, [
                (parts[p], fmt.encode(messages, stamp), _single(future, p, len(messages)))
            ]
        # every part is encoded before any is queued: a failure then appends nothing
        runs = list(groups.items())

        def finish(bases: list[int], error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
                return
            positions: list[Position] = [Position(-1, -1)] * len(messages)
            for (p, idx), base in zip(runs, bases, strict=True):
                for j, i in enumerate(idx):
                    positions[i] = Position(p, base + j)
            future.set_result(positions)

        gather = Parts(len(runs), finish)
        return future, [
            (parts[p], fmt.encode([messages[i] for i in idx], stamp), gather.part(k))
            for k, (p, idx) in enumerate(runs)
        ]

    def wait_for_room(self, refused: QueueFull, timeout: float) -> bool:
        self._check_open()
        return self._writer.wait_for_room(refused.needed, timeout)

    def flush(self, timeout: float | None = None) -> None:
        self._check_open()
        if self.read_only:
            return
        self._writer.wait_idle(timeout)
        for parts in list(self._topics.values()):
            for p in parts:
                p.mark_durable(p.sync())
                p.drop_synced()

    def _notify_arrivals(self) -> None:
        with self._arrivals:
            self.arrival_generation += 1
            self._arrivals.notify_all()
            watchers, self._watchers = self._watchers, []
        if watchers:
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            for loop, future in watchers:
                by_loop.setdefault(loop, []).append(future)
            for loop, futures in by_loop.items():  # one wake-up a loop, for all its waiters
                with contextlib.suppress(RuntimeError):  # (a closed loop: nothing waits)
                    loop.call_soon_threadsafe(_wake, futures)

    async def arrivals(self, since: int, timeout: float) -> None:
        """``wait_for_arrivals`` on the running loop, with no thread: the writer wakes the
        loop once records are visible."""
        if self.read_only:
            await asyncio.sleep(min(timeout, 0.05))
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._arrivals:
            if self.arrival_generation != since or self._closed:
                return
            self._watchers.append((loop, future))
        timer = loop.call_later(timeout, _wake, [future])
        try:
            await future
        finally:
            timer.cancel()
            with self._arrivals, contextlib.suppress(ValueError):  # (not woken by records)
                self._watchers.remove((loop, future))

    def wait_for_arrivals(self, since: int, timeout: float) -> None:
        """Block until records arrive after ``arrival_generation`` was ``since``, at most
        ``timeout`` seconds. Read-only, another process writes: look again shortly."""
        if self.read_only:
            time.sleep(min(timeout, 0.05))
            return
        with self._arrivals:
            self._arrivals.wait_for(
                lambda: self.arrival_generation != since or self._closed, timeout
            )

    # -- reading --------------------------------------------------------------------------
    def _visible(self, p: Partition) -> int:
        if self.read_only:
            p.refresh()
        return p.durable_offset

    def read(
        self,
        topic: str,
        partition: int,
        offset: int,
        max_records: int = 1000,
        max_bytes: int | None = None,
    ) -> list[Record]:
        if max_records < 1:
            raise InvalidArgument(f"max_records must be at least 1, not {max_records}")
        p = self._partition(topic, partition)
        return p.read(offset, max_records, max_bytes, self._visible(p))

    def read_arrow(
        self,
        topic: str,
        partition: int,
        offset: int,
        end: int | None = None,
        max_records: int = ARROW_MAX_RECORDS,
    ) -> list[pa.RecordBatch]:
        """The stored columns decoded straight into Arrow (``headwater.bus.embedded.arrow``);
        imported here, so that processes that never read Arrow do not load numpy and pyarrow."""
        from headwater.bus.embedded.arrow import record_batches

        if max_records < 1:
            raise InvalidArgument(f"max_records must be at least 1, not {max_records}")
        p = self._partition(topic, partition)
        spans = p.spans(offset, _END if end is None else end, max_records, self._visible(p))
        return record_batches(topic, partition, spans)

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        p = self._partition(topic, partition)
        return p.watermarks(self._visible(p))

    # -- groups ---------------------------------------------------------------------------
    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        self._check_writable()
        if not group:
            raise InvalidArgument("group name must not be empty")
        for (topic, partition), offset in offsets.items():
            low, high = self.watermarks(topic, partition)
            if not low <= offset <= high:
                raise InvalidArgument(
                    f"offset {offset} for {topic}/{partition} is outside the log ({low} to {high})"
                )
        self._offsets.commit(group, offsets)

    def committed(
        self, group: str, topics: Sequence[str] | None = None
    ) -> dict[TopicPartition, int]:
        self._check_open()
        if self.read_only:
            self._offsets.reload()
        return self._offsets.committed(group, topics)

    def groups(self) -> list[str]:
        self._check_open()
        if self.read_only:
            self._offsets.reload()
        return self._offsets.groups()

    def consumer(self, group: str, topics: Sequence[str]) -> Consumer:
        return EmbeddedConsumer(self, group, topics)

    # -- maintenance ----------------------------------------------------------------------
    def compact(self, topic: str | None = None) -> list[CompactionResult]:
        self._check_writable()
        names = [topic] if topic is not None else sorted(self._topics)
        results = []
        for name in names:
            for p in self._partitions(name):
                cutoff = self._offsets.lowest(name, p.index)
                results.append(compact_partition(p, p.durable_offset if cutoff is None else cutoff))
        return results

    def enforce_retention(self) -> int:
        """Delete closed segments past the retention limits; return how many were deleted."""
        self._check_writable()
        deleted = 0
        stamp = now_ms()
        for name, parts in list(self._topics.items()):
            for p in parts:
                protect = (
                    self._offsets.lowest(name, p.index)
                    if self.config.retention.respect_writers
                    else None
                )
                deleted += p.enforce_retention(stamp, protect)
        return deleted

    def _maintain(self, interval: float) -> None:
        while not self._stop_maintenance.wait(interval):
            try:
                deleted = self.enforce_retention()
            except BusClosed:
                return
            except Exception:  # keep the log serving; the next round tries again
                log.exception("retention of the log at %s failed", self.directory)
            else:
                if deleted:
                    log.info("retention deleted %d segments under %s", deleted, self.directory)

    def close(self) -> None:
        if self._closed:
            return
        self._stop_maintenance.set()
        self._closed = True
        self._writer.close()
        self._offsets.close()
        for parts in self._topics.values():
            for p in parts:
                p.close(clean=True)
        if not self.read_only:
            (self.directory / "CLEAN").touch()
        self._notify_arrivals()
        if self._lock is not None:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed(f"the log at {self.directory} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise InvalidArgument(f"the log at {self.directory} is open read-only")


def _wake(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


def _single(future: Future[Sequence[Position]], p: int, n: int) -> Done:
    def done(base: int, error: BaseException | None) -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(PositionRun(p, base, n))

    return done
