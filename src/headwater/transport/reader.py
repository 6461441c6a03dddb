"""What every transport reader shares: its state file, its status file, the durable append of
its changes to the log, and the registry of reader types.

A reader is a long-running loop on a thread of its own (``run(stop)``): it reads its source,
turns what it reads into ``Change`` messages, appends them to the log and only then records its
position (in its state file, and for PostgreSQL on the server). A restart resumes from that
position: nothing appended is lost, and what was appended but not yet recorded may come again
(at least once during recovery, exactly once otherwise).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson

from headwater.bus.base import Bus
from headwater.bus.errors import UnknownTopic
from headwater.bus.records import Message, Position, Record
from headwater.bus.waiting import append_many_waiting
from headwater.transport.config import ReaderConfig
from headwater.transport.message import BadMessage, Change, Mode, Op, decode, encode, topic_name

READERS = {
    "postgres": "headwater.transport.postgres.reader:PostgresReader",
    "files": "headwater.transport.files.reader:FilesReader",
    "kafka": "headwater.transport.kafka.reader:KafkaReader",
}
ROW_OPS = frozenset({Op.READ, Op.INSERT, Op.UPDATE, Op.DELETE})
STOP_WAIT_S = 30.0  # on stop, how long the last batch may take to become durable
STATE_FILE = "state.json"
STATUS_FILE = "status.json"


def write_json(path: Path, body: dict[str, Any]) -> None:
    """Replace ``path`` with ``body`` atomically and durably (write, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``, or ``{}`` when there is no such file."""
    try:
        body = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    if not isinstance(body, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return body


class Appender:
    """Appends a reader's changes to the log, a topic per namespace (made on first use), in
    batches; ``send`` returns futures that resolve once the batch is durable."""

    def __init__(self, bus: Bus, config: ReaderConfig) -> None:
        self._bus = bus
        self._config = config
        self._topics: dict[str, str] = {}
        self._partitions: dict[str, int] = {}
        self._pending: dict[str, list[Message]] = {}
        self.count = 0

    def topic(self, namespace: str, **parts: str) -> str:
        """The topic of ``namespace``, made on the bus the first time."""
        topic = self._topics.get(namespace)
        if topic is None:
            topic = topic_name(self._config.topic, self._config.id, namespace, **parts)
            if topic not in self._partitions:
                info = self._bus.create_topic(topic, partitions=self._config.partitions)
                self._partitions[topic] = info.partitions
            self._topics[namespace] = topic
        return topic

    def add(
        self, change: Change, mode: Mode, topic: str | None = None, pin: str | None = None
    ) -> None:
        """Add ``change``; one without a key (schema, truncate, complete) goes to every
        partition, so that it is ordered with every row's changes. Changes with the same ``pin``
        (a file, a source partition) go to one partition, in order, whatever their key."""
        topic = topic or self.topic(change.namespace)
        message = encode(change, mode)
        pending = self._pending.setdefault(topic, [])
        if pin is not None:
            count = self._partitions.get(topic) or self._bus.topic(topic).partitions
            pending.append(message._replace(partition=zlib.crc32(pin.encode()) % count))
        elif change.key is None and change.op not in ROW_OPS:
            pending.extend(message._replace(partition=p) for p in range(self._partitions[topic]))
        else:
            pending.append(message)
        self.count += 1

    def send(self) -> list[Future[Sequence[Position]]]:
        """Append what was added since the last send (waiting while the log's queue is full)."""
        if not self._pending:
            return []
        batches, self._pending, self.count = self._pending, {}, 0
        return append_many_waiting(self._bus, batches)


def wait_durable(futures: Sequence[Future[Sequence[Position]]], stop: threading.Event) -> bool:
    """Wait for every future. Once ``stop`` is set, wait ``STOP_WAIT_S`` more at most (so that
    the position of what was appended can still be saved); False when that ran out. A failed
    append raises."""
    deadline: float | None = None
    for f in futures:
        while True:
            try:
                f.result(timeout=0.5)
                break
            except TimeoutError:
                if stop.is_set():
                    deadline = deadline or time.monotonic() + STOP_WAIT_S
                    if time.monotonic() >= deadline:
                        return False
    return True


def log_tail(bus: Bus, topic: str, records: int) -> Iterator[Change]:
    """The transport changes among the last ``records`` records of each partition of ``topic``
    (none when it does not exist), newest first in each partition, one partition after the
    other. A reader that appends at most ``records`` changes between two saves of its state
    finds among them what it appended durably but had not recorded when it stopped."""
    try:
        partitions = bus.topic(topic).partitions
    except UnknownTopic:
        return
    for partition in range(partitions):
        low, high = bus.watermarks(topic, partition)
        floor, end, step = max(low, high - records), high, 64
        while end > floor:
            start = max(floor, end - step)
            for record in reversed(_read_range(bus, topic, partition, start, end)):
                try:
                    yield decode(record)[0]
                except BadMessage:
                    continue
            end, step = start, min(step * 4, 10_000)


def _read_range(bus: Bus, topic: str, partition: int, start: int, end: int) -> list[Record]:
    """The records of one partition in ``[start, end)``."""
    out: list[Record] = []
    while start < end:
        batch = bus.read(topic, partition, start, max_records=end - start)
        out.extend(r for r in batch if r.offset < end)
        if not batch:
            break
        start = batch[-1].offset + 1
    return out


class Reader(ABC):
    """A transport reader. ``run`` returns when ``stop`` is set, after recording its position
    for everything it appended."""

    def __init__(self, config: ReaderConfig, bus: Bus, state_dir: Path) -> None:
        self.config = config
        self.bus = bus
        self.state_dir = state_dir
        self.appender = Appender(bus, config)
        self._status: dict[str, Any] = {"id": config.id, "type": config.type, "namespaces": {}}
        self._status_at = 0.0

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def load_state(self) -> dict[str, Any]:
        return read_json(self.state_path)

    def save_state(self, state: dict[str, Any]) -> None:
        write_json(self.state_path, state)

    def report(self, force: bool = False, **fields: Any) -> None:
        """Update the status file (``headwater transport status`` reads it), at most once a
        second unless ``force``."""
        self._status.update(fields)
        now = time.time()
        if force or now - self._status_at >= 1.0:
            self._status["updated_at"] = now
            write_json(self.state_dir / STATUS_FILE, self._status)
            self._status_at = now

    def phase(self, namespace: str, phase: str, **fields: Any) -> None:
        """Record ``namespace``'s phase (copy, sync) and figures for the status."""
        entry = self._status["namespaces"].setdefault(namespace, {})
        entry["phase"] = phase
        entry.update(fields)

    @abstractmethod
    def run(self, stop: threading.Event) -> None:
        """Read until ``stop`` is set."""


def reader_class(type_name: str) -> Callable[[ReaderConfig, Bus, Path], Reader]:
    """The reader class registered for ``type_name``."""
    try:
        module, _, name = READERS[type_name].partition(":")
    except KeyError:
        known = ", ".join(READERS)
        raise ValueError(f"unknown reader type {type_name!r}; one of {known}") from None
    cls: Callable[[ReaderConfig, Bus, Path], Reader]
    cls = getattr(importlib.import_module(module), name)
    return cls


def read_status(state_dir: Path) -> dict[str, Any]:
    """A reader's last status, or ``{}`` when it never ran."""
    return read_json(state_dir / STATUS_FILE)
