"""An ``http`` destination's delivery inside one Spark task: the task's query hands its rows
over chunk by chunk (``TaskSender.add``, from the sink's ``stage``) while a thread of the task's
own, with its own event loop, delivers them (``TaskDelivery``); ``finish`` waits until every
session's batches are delivered or given up.

The rows are the pipeline's archive rows (``event``: the event's JSON after the steps,
``_timestamp``, ``_hw_session``: the session key the frame was partitioned by, NULL when the
destination has no ``group_by``) with the source record (``RECORD_COLUMNS``) kept for the failed
store. Memory is bounded: ``add`` blocks while two chunks wait and the delivery's queued batches
are past their bound, so a task whose receiver is down stops reading its input; the events wait
on the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headwater.delivery.bodies import BodyFormat, Event, Pack
from headwater.delivery.config import HttpDeliveryConfig
from headwater.delivery.metrics import Tally
from headwater.delivery.sender import Sender
from headwater.delivery.sessions import Report, TaskDelivery
from headwater.destinations.base import (
    ARCHIVE_EVENT,
    ARCHIVE_TIMESTAMP,
    RECORD_COLUMNS,
    SESSION_COLUMN,
)
from headwater.http.client import HttpClient

GIVEN_UP = "HW-DLV-002"  # the receiver kept failing, or answered a terminal 4xx
TOO_LARGE = "HW-DLV-003"  # larger than max_batch_bytes even trimmed
_QUEUED_CHUNKS = 2
_PUT_WAIT_S = 0.1  # how often a blocked ``add`` looks whether the delivery has stopped

Items = list[tuple[str, Pack | Event]]


def items(rows: pa.Table, default_key: str, fmt: BodyFormat, room: int) -> Items:
    """A chunk of archive rows as ``(session key, pack)`` pairs: the rows grouped by session
    (each group in the rows' order) with their items made in one pass (no Python object per
    event). An event whose item is larger than ``room`` comes alone, as an ``Event``, to be
    trimmed. Each pack and event remembers its rows, for the failed store."""
    n = rows.num_rows
    if not n:
        return []
    stamps = _array(rows.column(ARCHIVE_TIMESTAMP))
    factor = _NANOS.get(getattr(stamps.type, "unit", "us"), 1_000)
    nanos = pc.multiply(stamps.cast(pa.int64()), factor)
    texts = _array(rows.column(ARCHIVE_EVENT))
    if pa.types.is_large_string(texts.type):  # Spark's, with useLargeVarTypes: a chunk is small
        texts = texts.cast(pa.string())
    order, keys, bounds = _sessions(rows, default_key)
    if order is None:
        order = np.arange(n)
    else:  # the rows in session order, before their items are made: one copy
        picked = pa.array(order)
        texts = pc.take(texts, picked, memory_pool=_POOL)
        nanos = pc.take(nanos, picked, memory_pool=_POOL)
    made = fmt.items(texts, nanos, memory_pool=_POOL)
    offsets = np.frombuffer(made.buffers()[1], np.int32, n + 1, made.offset * 4).astype(np.int64)
    data = memoryview(made.buffers()[2])  # type: ignore[union-attr]
    at_byte = offsets.tolist()
    big = np.flatnonzero(np.diff(offsets) > room)  # rows too large for a batch
    first, last = np.searchsorted(big, bounds[:-1]), np.searchsorted(big, bounds[1:])
    out: Items = []
    groups = zip(keys, bounds[:-1], bounds[1:], first.tolist(), last.tolist(), strict=True)
    for key, start, stop, lo, hi in groups:
        at = start
        for b in [*big[lo:hi].tolist(), stop]:
            if b > at:
                base = at_byte[at]
                run = offsets[at + 1 : b + 1] - base
                out.append((key, Pack(data[base : at_byte[b]], run, (rows, order[at:b]))))
            if b < stop:  # too large for a batch: alone, as an event, to be trimmed
                text = texts[b].as_py().encode()
                source = (rows, order[b : b + 1])
                out.append((key, Event(text, int(nanos[b].as_py() or 0), source)))
            at = b + 1
    return out


def _array(column: pa.ChunkedArray) -> pa.Array:
    """A column as one array (without a copy when it is one chunk, as a task's are)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _sessions(rows: pa.Table, default_key: str) -> tuple[np.ndarray | None, list[str], list[int]]:
    """The order that groups ``rows`` by session (each group in the rows' order; None: they
    are one group already), each group's key, and where the groups start in that order (with
    the row count last)."""
    n = rows.num_rows
    if SESSION_COLUMN not in rows.column_names:
        return None, [default_key], [0, n]
    encoded = pc.dictionary_encode(pc.fill_null(_array(rows.column(SESSION_COLUMN)), default_key))
    names = encoded.dictionary.to_pylist()
    if len(names) == 1:
        return None, names, [0, n]
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    if len(names) <= np.iinfo(np.int16).max:
        codes = codes.astype(np.int16)  # numpy sorts 16-bit keys by radix: ~8x faster
    order = np.argsort(codes, kind="stable")
    codes = codes[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(codes)) + 1))
    return order, [names[c] for c in codes[starts].tolist()], [*starts.tolist(), n]


# Where a chunk's session-ordered texts and items are allocated (~2.5 MB blocks that live until
# their batches are sent): the C library's malloc. With Arrow's default pool (mimalloc) one
# task's delivery ran slower in a new process: 0.64-0.68 of the bare client against 0.70-0.72
# (bench/delivery.py --skip-pipeline, run 1; later runs 0.81-0.89 either way).
_POOL = pa.system_memory_pool()

_NANOS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def source_records(packs: list[Pack] | list[Event]) -> list[dict[str, Any]]:
    """The source records of packs' or events' rows (as the failed store takes them)."""
    out: list[dict[str, Any]] = []
    for item in packs:
        rows, numbers = item.sources if isinstance(item, Pack) else item.source
        if isinstance(rows, str):  # a pack of single events: each its own (rows, numbers)
            out += source_records([Event(b"", 0, s) for s in numbers])
            continue
        out += rows.take(pa.array(numbers)).select(list(RECORD_COLUMNS)).to_pylist()
    return out


class TaskSender:
    """One task's delivery on its own thread (see the module's docstring)."""

    def __init__(
        self, settings: HttpDeliveryConfig, destination: str, batch_id: int, default_key: str
    ) -> None:
        self.settings = settings
        self.destination = destination
        self.batch_id = batch_id
        self.default_key = default_key
        self.report: Report | None = None
        self.tally = Tally()
        self.error: BaseException | None = None
        self._chunks: queue.Queue[pa.Table | None] = queue.Queue(maxsize=_QUEUED_CHUNKS)
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"hw-deliver-{destination}-{batch_id}", daemon=True
        )
        self._thread.start()

    def add(self, rows: pa.Table) -> None:
        """Hand a chunk of rows over; blocks while the delivery is behind; raises what stopped
        the delivery (``DestinationRefused``). The rows become events on the delivery's
        thread, while the task's thread goes on with its query (which runs without the GIL)."""
        self._put(rows)

    def finish(self) -> Report:
        """Wait until every event is delivered or given up."""
        self._put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report

    def cancel(self) -> None:
        """Stop sending (the task failed): requests in flight are abandoned."""
        loop, main = self._loop, self._main
        if loop is not None and main is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(main.cancel)
        while not self._stopped.is_set():
            with contextlib.suppress(queue.Empty):
                self._chunks.get_nowait()  # make room for the end marker
            with contextlib.suppress(queue.Full):
                self._chunks.put_nowait(None)
            self._thread.join(_PUT_WAIT_S)

    def _put(self, chunk: pa.Table | None) -> None:
        while True:
            if self.error is not None:
                raise self.error
            if self._stopped.is_set():
                raise RuntimeError("the task's delivery has stopped")
            with contextlib.suppress(queue.Full):
                self._chunks.put(chunk, timeout=_PUT_WAIT_S)
                return

    def _run(self) -> None:
        try:
            asyncio.run(self._deliver())
        except BaseException as exc:  # handed to the task's thread by add/finish
            self.error = exc
        finally:
            self._stopped.set()

    async def _deliver(self) -> None:
        self._loop, self._main = asyncio.get_running_loop(), asyncio.current_task()
        async with HttpClient() as http:
            sender = Sender(self.settings, http)
            self.tally = sender.tally
            delivery = TaskDelivery(sender, self.destination, self.batch_id)
            self.report = await delivery.run(self._stream(sender.format, delivery.batch_room()))

    async def _stream(self, fmt: BodyFormat, room: int) -> AsyncIterator[Items]:
        while True:
            chunk = await asyncio.to_thread(self._chunks.get)
            if chunk is None:
                return
            yield items(chunk, self.default_key, fmt, room)


def given_up(report: Report) -> list[tuple[list[dict[str, Any]], str, str]]:
    """The source records of the report's events that were not delivered, with why:
    ``(records, code, reason)``."""
    out = [(source_records(packs), GIVEN_UP, reason) for packs, reason in report.outcome.failed]
    out += [(source_records([event]), TOO_LARGE, reason) for event, reason in report.too_large]
    return out


OnFailed = Callable[[list[tuple[dict[str, Any], str, str]]], None]
