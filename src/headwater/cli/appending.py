"""What ``headwater log append`` does with its input: JSON lines read and checked in batches,
appended in input order while the log takes them (waiting on its backpressure), and counted
durable only as a prefix of the input, so that a stopped command can say exactly where to
resume.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, BinaryIO

from headwater.bus import Bus
from headwater.bus.errors import QueueFull
from headwater.bus.records import Message, Position
from headwater.bus.waiting import append_waiting
from headwater.errors import HeadwaterError

#: A batch is appended (and its lines checked) once it holds this many lines or bytes.
BATCH_LINES = 1000
BATCH_BYTES = 4 << 20
PROGRESS_EVERY_S = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class BadLine:
    line: int
    message: str


@dataclass
class Batch:
    """Input lines ``first..last`` (1-based; blank ones included) as records, or the reasons
    some of them are bad."""

    first: int
    last: int = 0
    messages: list[Message] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)


@dataclass
class PartitionSpan:
    count: int
    first_offset: int
    last_offset: int


def read_batches(
    stream: BinaryIO,
    key_field: str | None,
    partition: int | None,
    max_record_bytes: int,
    stop: threading.Event,
) -> Iterator[Batch]:
    """The input in batches of whole lines; stops reading (mid-batch, dropping it) once
    ``stop`` is set."""
    batch = Batch(first=1)
    size = 0
    number = 0
    for number, raw in enumerate(stream, start=1):
        if stop.is_set():
            return
        batch.last = number
        parsed = _parse_line(raw, key_field, partition, max_record_bytes)
        if isinstance(parsed, str):
            batch.bad.append(BadLine(number, parsed))
        elif parsed is not None:
            batch.messages.append(parsed)
            size += len(parsed.value)
        if number - batch.first + 1 >= BATCH_LINES or size >= BATCH_BYTES:
            yield batch
            batch, size = Batch(first=number + 1), 0
    if batch.last and not stop.is_set():
        yield batch


def _parse_line(
    raw: bytes, key_field: str | None, partition: int | None, max_bytes: int
) -> Message | str | None:
    """The record of one input line, None for a blank line, or why the line is bad."""
    line = raw[:-1] if raw.endswith(b"\n") else raw
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip():
        return None
    try:
        document = json.loads(line, parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 (byte {exc.start})"
    except ValueError as exc:
        return f"invalid JSON: {exc}"
    key: bytes | None = None
    if key_field is not None:
        key_text, problem = key_of(document, key_field)
        if key_text is None:
            return problem
        key = key_text.encode("utf-8")
    size = len(line) + len(key or b"")
    if size > max_bytes:
        return f"the record is {size} bytes; the bus takes at most {max_bytes}"
    return Message(value=line, key=key, partition=partition)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def key_of(document: Any, field: str) -> tuple[str | None, str]:
    """The string value of ``field`` in ``document``, or ``(None, why not)``."""
    if not isinstance(document, dict):
        return None, f"not a JSON object, so it has no key field {field!r}"
    if field in document:
        value = document[field]
    else:
        value = document
        for part in field.split("."):
            if not isinstance(value, dict) or part not in value:
                return None, f"missing key field {field!r}"
            value = value[part]
    if isinstance(value, str):
        return value, ""
    if isinstance(value, bool | int | float):
        return json.dumps(value), ""
    kind = "null" if value is None else type(value).__name__.replace("dict", "object")
    return None, f"key field {field!r} is {kind}; it must be a string or a number"


class Appender:
    """Appends batches in input order and keeps ``durable_lines``: the longest prefix of input
    lines whose every batch is durable. Batches are in flight on several partitions at once;
    ``finish`` waits for every one of them, so what it reports is all that landed, and, as long
    as no batch failed, exactly a prefix of the input."""

    def __init__(self, bus: Bus, topic: str, stop: threading.Event) -> None:
        self.bus = bus
        self.topic = topic
        self.stop = stop
        self.durable_lines = 0
        self.records = 0
        self.partitions: dict[int, PartitionSpan] = {}
        self.error: BaseException | None = None
        self.beyond: list[tuple[int, int]] = []  # line ranges that landed after a failed batch
        self._in_flight: deque[tuple[Future[Sequence[Position]], Batch]] = deque()

    def add(self, batch: Batch) -> bool:
        """Append ``batch`` once the log has room (a stop gives the wait up: nothing of it is
        appended then); False once a stop or an earlier batch's failure ended the appends."""
        self._collect(block=False)
        if self.error is not None or self.stop.is_set():
            return False
        if not batch.messages:
            done: Future[Sequence[Position]] = Future()
            done.set_result([])
            self._in_flight.append((done, batch))
            return True
        try:
            future = append_waiting(self.bus, self.topic, batch.messages, stop=self.stop)
        except QueueFull:
            if self.stop.is_set():
                return False
            raise
        except HeadwaterError as e:  # refused at once: nothing of the batch was queued
            self.error = e
            return False
        self._in_flight.append((future, batch))
        return True

    def finish(self) -> None:
        """Wait for every batch in flight (each ends durable or failed), then flush."""
        self._collect(block=True)
        if self.error is None:
            self.bus.flush()

    def _collect(self, *, block: bool) -> None:
        while self._in_flight and (block or self._in_flight[0][0].done()):
            future, batch = self._in_flight.popleft()
            try:
                positions = future.result()
            except Exception as e:  # reported with the lines it cost
                self.error = self.error or e
                continue
            if self.error is not None:
                self.beyond.append((batch.first, batch.last))
                continue
            self.durable_lines = batch.last
            self._count(positions)

    def _count(self, positions: Sequence[Position]) -> None:
        self.records += len(positions)
        for pos in positions:
            span = self.partitions.get(pos.partition)
            if span is None:
                self.partitions[pos.partition] = PartitionSpan(1, pos.offset, pos.offset)
            else:
                span.count += 1
                span.first_offset = min(span.first_offset, pos.offset)
                span.last_offset = max(span.last_offset, pos.offset)


class Progress:
    """One line on stderr, rewritten in place, when stderr is a terminal; nothing otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._started = time.monotonic()
        self._shown = 0.0

    def show(self, lines: int, durable: int, records: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._shown < PROGRESS_EVERY_S:
            return
        self._shown = now
        rate = records / max(now - self._started, 1e-9)
        sys.stderr.write(
            f"\r{lines:,} lines read, {durable:,} durable, {records:,} records ({rate:,.0f}/s) "
        )
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


class Stop:
    """How a command is asked to stop: ``event`` is set on SIGINT or SIGTERM (``signals`` lists
    those received). While ``reading`` (input that may block, such as a terminal or an idle
    pipe), a signal also raises ``KeyboardInterrupt``: nothing is half-done there."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals: list[int] = []
        self._reading = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signals.append(signum)
        self.event.set()
        if self._reading:
            raise KeyboardInterrupt

    def next_batch(self, batches: Iterator[Batch]) -> Batch | None:
        """The next batch, or None at the end of the input or once stopped."""
        if self.event.is_set():
            return None
        try:
            self._reading = True
            try:
                return next(batches, None)
            finally:
                self._reading = False
        except KeyboardInterrupt:
            return None


@contextmanager
def stop_on_signals() -> Iterator[Stop]:
    """While inside, SIGINT and SIGTERM ask the command to ``Stop`` instead of interrupting
    whatever it does. Outside the main thread, signals are left alone."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
