"""A Spark task's share of an ``http`` destination's micro-batch: its events, each with its
session key (the values of ``group_by``), delivered per session (seed 001):

- a session's events are added to its buffer in log order until the next one would pass
  ``max_batch_bytes``; then the buffer becomes a batch, queued for the session;
- each session has **at most one request in flight** (seed D1) and sends its batches in order;
  up to ``max_parallel_sessions`` sessions send at once;
- an event too large for any batch is trimmed (``bodies.trim``) or, when it cannot be, goes to
  the failed store;
- memory is bounded: when the queued batches pass ``max_pending_bytes`` the task stops reading
  its input until they drain (the events wait on the log, not in memory: no KI1);
- a failing session never stops the others; the task ends when every session's batches are
  delivered or their events failed-stored.

Batches are cut only by size and at the end of the input, never by a clock, so a micro-batch
replayed after a crash makes the same batches with the same idempotency keys
(``<destination>:<batch id>:<session>:<sequence>``). ``max_lifetime_s`` is honoured by the
stream trigger (a micro-batch at least that often), not inside a task.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import numpy as np

from headwater.delivery.bodies import Event, Pack, trim
from headwater.delivery.sender import Outcome, Sender


def session_name(destination: str, key: str) -> str:
    """The session a key's events are sent in: stable across batches and tasks."""
    digest = hashlib.sha256(f"{destination}\0{key}".encode()).hexdigest()[:24]
    return f"{destination}-{digest}"


@dataclass
class _Session:
    name: str
    packs: list[Pack] = field(default_factory=list)  # the buffer
    size: int = 0  # of the events in the buffer, in the body
    queue: deque[tuple[list[Pack], int]] = field(default_factory=deque)  # batch, bytes
    sequence: int = 0
    sending: asyncio.Task[None] | None = None
    room: int = 0  # bytes a batch's events may take


@dataclass
class Report:
    outcome: Outcome = field(default_factory=Outcome)
    sessions: int = 0
    too_large: list[tuple[Event, str]] = field(default_factory=list)


class TaskDelivery:
    def __init__(
        self,
        sender: Sender,
        destination: str,
        batch_id: int,
        *,
        max_pending_bytes: int | None = None,
    ) -> None:
        self.sender = sender
        self.config = sender.config
        self.format = sender.format
        self.destination = destination
        self.batch_id = batch_id
        limit = self.config.max_batch_bytes
        self.max_pending_bytes = max(max_pending_bytes or self.config.max_pending_bytes, 2 * limit)
        self._sessions: dict[str, _Session] = {}
        self._slots = asyncio.Semaphore(self.config.max_parallel_sessions)
        self._pending_bytes = 0
        self._drained = asyncio.Event()
        self._error: BaseException | None = None
        self.report = Report()

    async def run(
        self,
        events: Iterable[tuple[str, Pack | Event]]
        | AsyncIterator[Iterable[tuple[str, Pack | Event]]],
    ) -> Report:
        """Deliver every ``(session key, pack or event)`` (or every one of each chunk an async
        iterator gives); raises what stopped the destination (``DestinationRefused``) after the
        sessions in flight have ended."""
        try:
            if isinstance(events, AsyncIterator):
                async for chunk in events:
                    for key, item in chunk:
                        if self._add(key, item):
                            await self._wait()
            else:
                for key, item in events:
                    if self._add(key, item):
                        await self._wait()
            for session in self._sessions.values():
                self._seal(session)
        finally:
            running = [s.sending for s in self._sessions.values() if s.sending is not None]
            while running:
                await asyncio.gather(*running, return_exceptions=True)
                running = [
                    s.sending
                    for s in self._sessions.values()
                    if s.sending is not None and not s.sending.done()
                ]
        if self._error is not None:
            raise self._error
        self.report.sessions = len(self._sessions)
        return self.report

    def batch_room(self) -> int:
        """Bytes a batch's events may take (session names have one length): an event whose
        item is larger is too large, and is to be ``add``ed as an ``Event``, to be trimmed."""
        return self.config.max_batch_bytes - self.format.fixed(session_name(self.destination, ""))

    def _session(self, key: str) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session(session_name(self.destination, key))
            session.room = self.config.max_batch_bytes - self.format.fixed(session.name)
        return session

    def _add(self, key: str, item: Pack | Event) -> bool:
        """Add events to their session's buffer, sealing it into a batch whenever the next
        event would not fit; True when the caller must wait for the queued batches to drain
        (backpressure)."""
        if self._error is not None:
            raise self._error
        session = self._session(key)
        if isinstance(item, Event):
            if self.format.cost(item) > session.room:  # too large for any batch
                fitted = trim(item, session.room, self.format)
                if fitted is None:
                    limit = self.config.max_batch_bytes
                    why = f"the event is larger than max_batch_bytes ({limit}) even when trimmed"
                    self.report.too_large.append((item, why))
                    return False
                item = fitted
            item = self.format.pack([item])
        ends, at, base = item.ends, 0, 0
        while at < item.count:
            fits = int(np.searchsorted(ends, base + session.room - session.size, side="right"))
            if fits > at:
                session.packs.append(item.slice(at, fits) if at or fits < item.count else item)
                session.size += int(ends[fits - 1]) - base
                at, base = fits, int(ends[fits - 1])
            if at < item.count:
                if not session.packs:
                    raise ValueError("an item larger than a batch reached a session's buffer")
                self._seal(session)
        return self._pending_bytes > self.max_pending_bytes

    async def _wait(self) -> None:
        while self._pending_bytes > self.max_pending_bytes and self._error is None:
            self._drained.clear()
            await self._drained.wait()  # backpressure: stop reading until batches are sent

    def _seal(self, session: _Session) -> None:
        """The buffer becomes the session's next batch; start its sender if idle."""
        if not session.packs:
            return
        session.queue.append((session.packs, session.size))
        self._pending_bytes += session.size
        session.packs, session.size = [], 0
        if session.sending is None or session.sending.done():
            session.sending = asyncio.create_task(self._drain(session))

    async def _drain(self, session: _Session) -> None:
        """Send the session's batches one after another: one request in flight per session."""
        async with self._slots:
            while session.queue and self._error is None:
                batch, size = session.queue[0]
                key = f"{self.destination}:{self.batch_id}:{session.name}:{session.sequence}"
                try:
                    outcome = await self.sender.send(session.name, key, batch)
                except BaseException as e:
                    self._error = e
                    self._drained.set()
                    raise
                session.queue.popleft()
                session.sequence += 1
                self._pending_bytes -= size
                self.report.outcome.add(outcome)
                self._drained.set()
