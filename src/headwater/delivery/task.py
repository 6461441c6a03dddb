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

import pyarrow as pa
import pyarrow.compute as pc

from headwater.delivery.bodies import Event
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
from headwater.http_client import HttpClient

GIVEN_UP = "HW-DLV-002"  # the receiver kept failing, or answered a terminal 4xx
TOO_LARGE = "HW-DLV-003"  # larger than max_batch_bytes even trimmed
_QUEUED_CHUNKS = 2
_PUT_WAIT_S = 0.1  # how often a blocked ``add`` looks whether the delivery has stopped

Items = list[tuple[str, Event]]


def items(rows: pa.Table, default_key: str) -> Items:
    """The ``(session key, event)`` pairs of a chunk of archive rows, in order; each event
    remembers its row (``Event.source``) for the failed store."""
    texts = rows.column(ARCHIVE_EVENT).cast(pa.binary()).to_pylist()  # bytes, no str between
    stamps = rows.column(ARCHIVE_TIMESTAMP)
    factor = _NANOS.get(getattr(stamps.type, "unit", "us"), 1_000)
    nanos = pc.multiply(stamps.cast(pa.int64()), factor).to_pylist()
    keys = (
        rows.column(SESSION_COLUMN).to_pylist()
        if SESSION_COLUMN in rows.column_names
        else [None] * rows.num_rows
    )
    return [
        (default_key if key is None else key, Event(text, ns or 0, (rows, i)))
        for i, (text, ns, key) in enumerate(zip(texts, nanos, keys, strict=True))
    ]


_NANOS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def source_records(events: list[Event]) -> list[dict[str, Any]]:
    """The source records of delivered events (as the failed store takes them)."""
    out: list[dict[str, Any]] = []
    for event in events:
        rows, i = event.source
        out.append(rows.slice(i, 1).select(list(RECORD_COLUMNS)).to_pylist()[0])
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
            self.report = await delivery.run(self._stream())

    async def _stream(self) -> AsyncIterator[Items]:
        while True:
            chunk = await asyncio.to_thread(self._chunks.get)
            if chunk is None:
                return
            yield items(chunk, self.default_key)


def given_up(report: Report) -> list[tuple[list[Event], str, str]]:
    """The report's events that were not delivered: ``(events, code, reason)``."""
    out = [(events, GIVEN_UP, reason) for events, reason in report.outcome.failed]
    out += [([event], TOO_LARGE, reason) for event, reason in report.too_large]
    return out


OnFailed = Callable[[list[tuple[dict[str, Any], str, str]]], None]
