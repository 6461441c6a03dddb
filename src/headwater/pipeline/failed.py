"""The failed store: every event a step or a write could not handle, with why.

It is a topic (``pipeline.failed_topic``, default ``headwater-failed``) so that it is durable
and inspectable with the log tools. On Kafka it lives on the cluster; with the embedded log it
is a log of its own under ``<data_dir>/failed`` (the main log has one writer, the collector),
opened briefly by whoever appends, so the pipeline and ``headwater failed replay`` can share it.

A failed record keeps the original key, value (the bytes exactly as the client sent them) and
headers, and adds headers (``hw-failed-*``): its id, the destination, the step, the error code,
the reason, where the event was on the log (topic/partition/offset) and when it failed. The id
``<destination>:<topic>:<partition>:<offset>`` is also the record's key, so a batch that is
failed again after a crash is the same failed event (``list`` shows it once).

Replay (``replay``) appends the chosen events, with their original headers, to the topic
``headwater-replay.<destination>`` of the same store; each destination's query reads that topic
too, so replayed events pass through the same steps and the same exactly-once write.

Pages (``page``, for the console) read the store backwards from the high watermark, in chunks of
Arrow columns (``Bus.read_arrow``: on the embedded log no Python object per record), filter on the
``hw-failed-*`` headers while reading and stop once the page is full: the cost follows the page and
how deep its cursor is, not the size of the store.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from headwater.bus import Bus, Message, Record, open_bus
from headwater.bus.errors import LogLocked
from headwater.bus.waiting import append_waiting
from headwater.config.model import HeadwaterConfig

if TYPE_CHECKING:
    import pyarrow as pa

PREFIX = "hw-failed-"
ID, DESTINATION, STEP, CODE, REASON = (
    f"{PREFIX}{k}" for k in ("id", "destination", "step", "code", "reason")
)
TOPIC, PARTITION, OFFSET, AT = (f"{PREFIX}{k}" for k in ("topic", "partition", "offset", "at"))
KEY = f"{PREFIX}key"  # the original key, base64 (the record's own key is the failed id)
REPLAY_OF = "hw-replay-of"
REPLAY_TOPIC_PREFIX = "headwater-replay."
LOCK_WAIT_S = 30.0
CHUNK = 4096  # records a backward read takes first; each further read of a partition takes 4x
MAX_CHUNK = 65_536
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class FailedEvent:
    id: str
    destination: str
    step: str
    code: str
    reason: str
    topic: str
    partition: int
    offset: int
    failed_at: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]  # the original headers

    def to_json(self, *, with_value: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "destination": self.destination,
            "step": self.step,
            "code": self.code,
            "reason": self.reason,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "failed_at": self.failed_at,
        }
        if with_value:
            out["key"] = None if self.key is None else _show(self.key)
            out["value"] = _show(self.value)
            out["headers"] = {k: _show(v) for k, v in self.headers}
        return out


def _show(data: bytes) -> str | dict[str, str]:
    """UTF-8 text as is, anything else as ``{"base64": ...}``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def failed_config(config: HeadwaterConfig) -> HeadwaterConfig:
    """The config of the bus that holds the failed store."""
    if config.bus.backend != "embedded":
        return config
    embedded = config.bus.embedded.model_copy(
        update={"path": config.data_dir / "failed", "default_partitions": 1}
    )
    return config.model_copy(update={"bus": config.bus.model_copy(update={"embedded": embedded})})


def replay_topic(destination: str) -> str:
    return f"{REPLAY_TOPIC_PREFIX}{destination}"


def make_id(destination: str, topic: str, partition: int, offset: int) -> str:
    return f"{destination}:{topic}:{partition}:{offset}"


def to_message(event: FailedEvent) -> Message:
    extra = [
        (ID, event.id),
        (DESTINATION, event.destination),
        (STEP, event.step),
        (CODE, event.code),
        (REASON, event.reason),
        (TOPIC, event.topic),
        (PARTITION, str(event.partition)),
        (OFFSET, str(event.offset)),
        (AT, event.failed_at),
    ]
    if event.key is not None:
        extra.append((KEY, base64.b64encode(event.key).decode("ascii")))
    headers = event.headers + tuple((k, v.encode()) for k, v in extra)
    return Message(value=event.value, key=event.id.encode(), headers=headers)


def from_record(record: Record) -> FailedEvent | None:
    """The failed event a record of the store holds (None for a record that is not one)."""
    ours = {k: v.decode("utf-8", "replace") for k, v in record.headers if k.startswith(PREFIX)}
    if ID not in ours:
        return None
    original = tuple((k, v) for k, v in record.headers if not k.startswith(PREFIX))
    return FailedEvent(
        id=ours[ID],
        destination=ours.get(DESTINATION, ""),
        step=ours.get(STEP, ""),
        code=ours.get(CODE, ""),
        reason=ours.get(REASON, ""),
        topic=ours.get(TOPIC, ""),
        partition=int(ours.get(PARTITION, "-1")),
        offset=int(ours.get(OFFSET, "-1")),
        failed_at=ours.get(AT, ""),
        key=base64.b64decode(ours[KEY]) if KEY in ours else None,
        value=record.value,
        headers=original,
    )


def now_iso() -> str:
    return iso_at(datetime.now(UTC).timestamp())


def iso_at(seconds: float) -> str:
    """A time as the store writes ``failed_at`` (UTC, milliseconds, ``Z``): text that sorts as
    time does."""
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class FailedStore:
    """Appends to and reads the failed store."""

    def __init__(self, config: HeadwaterConfig) -> None:
        self.config = failed_config(config)
        self.topic = config.pipeline.failed_topic

    def open(self, *, read_only: bool) -> Bus:
        deadline = time.monotonic() + LOCK_WAIT_S
        delay = 0.01
        while True:
            if self.config.bus.backend == "embedded" and not read_only:
                self.config.data_dir.mkdir(parents=True, exist_ok=True)
            try:
                return open_bus(self.config, read_only=read_only)
            except LogLocked:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)  # another process appends right now: wait for its lock
                delay = min(delay * 2, 0.2)

    def append(self, events: Sequence[FailedEvent], topic: str | None = None) -> None:
        """Append ``events`` durably (to the store's topic, or ``topic``)."""
        if not events:
            return
        with self.open(read_only=False) as bus:
            name = topic or self.topic
            bus.create_topic(name)
            append_waiting(bus, name, [to_message(e) for e in events]).result()
            bus.flush()

    def ensure_topic(self, topic: str) -> None:
        """Create ``topic`` on the store's bus unless it exists (Spark's Kafka connector fails a
        query over a topic that does not exist)."""
        with self.open(read_only=False) as bus:
            bus.create_topic(topic)

    def records(self, topic: str | None = None) -> Iterator[Record]:
        with self.open(read_only=True) as bus:
            name = topic or self.topic
            if name not in {t.name for t in bus.topics()}:
                return
            info = bus.topic(name)
            for p in range(info.partitions):
                low, high = bus.watermarks(name, p)
                offset = low
                while offset < high:
                    batch = bus.read(name, p, offset, max_records=5000)
                    if not batch:
                        break
                    yield from batch
                    offset = batch[-1].offset + 1

    def events(self, destination: str | None = None, since: str | None = None) -> list[FailedEvent]:
        """The failed events (the latest record per id), oldest first."""
        latest: dict[str, FailedEvent] = {}
        for record in self.records():
            event = from_record(record)
            if event is None:
                continue
            if destination is not None and event.destination != destination:
                continue
            if since is not None and event.failed_at < since:
                continue
            latest.pop(event.id, None)
            latest[event.id] = event
        return list(latest.values())

    def get(self, event_id: str) -> FailedEvent | None:
        """The latest record of ``event_id``, or None. It is the record key: each partition is
        read backwards until its first record with that key, so a recent failure is found at
        once and an unknown id reads the whole store."""
        import pyarrow as pa
        import pyarrow.compute as pc

        key = pa.scalar(event_id.encode(), pa.binary())
        with self.open(read_only=True) as bus:
            if self.topic not in {t.name for t in bus.topics()}:
                return None
            for p in range(bus.topic(self.topic).partitions):
                low, end = bus.watermarks(self.topic, p)
                size = CHUNK
                while end > low:
                    start = max(low, end - size)
                    for batch in reversed(read_range(bus, self.topic, p, start, end)):
                        hits = pc.indices_nonzero(pc.equal(batch.column("key"), key)).to_pylist()
                        for i in reversed(hits):
                            event = event_at(batch, i)
                            if event is not None and event.id == event_id:
                                return event
                    end, size = start, min(size * 4, MAX_CHUNK)
        return None

    def total(self) -> int:
        """The records in the store's topic (high minus low watermark, summed over partitions),
        without reading one: an upper bound on the failed events, since an id failed again
        has several records and compaction leaves gaps."""
        with self.open(read_only=True) as bus:
            if self.topic not in {t.name for t in bus.topics()}:
                return 0
            total = 0
            for p in range(bus.topic(self.topic).partitions):
                low, high = bus.watermarks(self.topic, p)
                total += high - low
            return total

    def replay(self, events: Sequence[FailedEvent]) -> dict[str, int]:
        """Append ``events`` to their destinations' replay topics; returns counts per one."""
        by_destination: dict[str, list[Message]] = {}
        for e in events:
            headers = (*e.headers, (REPLAY_OF, e.id.encode()))
            by_destination.setdefault(e.destination, []).append(
                Message(value=e.value, key=e.key, headers=headers)
            )
        if not by_destination:
            return {}
        with self.open(read_only=False) as bus:
            for destination, messages in by_destination.items():
                topic = replay_topic(destination)
                bus.create_topic(topic)
                append_waiting(bus, topic, messages).result()
            bus.flush()
        return {d: len(m) for d, m in by_destination.items()}


def read_range(bus: Bus, topic: str, partition: int, start: int, end: int) -> list[pa.RecordBatch]:
    """The records ``[start, end)`` of a partition as Arrow batches, in offset order."""
    out: list[pa.RecordBatch] = []
    offset = start
    while offset < end:
        batches = bus.read_arrow(topic, partition, offset, end, max_records=end - offset)
        if not batches:
            break
        out += batches
        offset = batches[-1].column("offset")[-1].as_py() + 1
    return out


def event_at(batch: pa.RecordBatch, index: int) -> FailedEvent | None:
    """The failed event in row ``index`` of an Arrow batch of the store."""
    row = batch.slice(index, 1).to_pylist()[0]
    record = Record(
        topic=row["topic"],
        partition=row["partition"],
        offset=row["offset"],
        timestamp=(row["timestamp"] - _EPOCH) // timedelta(milliseconds=1),
        key=row["key"],
        value=row["value"],
        headers=tuple((h["key"], h["value"]) for h in row["headers"]),
    )
    return from_record(record)
