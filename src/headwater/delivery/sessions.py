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

from headwater.delivery.bodies import Event, trim
from headwater.delivery.sender import Outcome, Sender


def session_name(destination: str, key: str) -> str:
    """The session a key's events are sent in: stable across batches and tasks."""
    digest = hashlib.sha256(f"{destination}\0{key}".encode()).hexdigest()[:24]
    return f"{destination}-{digest}"


@dataclass
class _Session:
    name: str
    events: list[Event] = field(default_factory=list)
    size: int = 0  # of the events in the buffer, in the body
    queue: deque[tuple[list[Event], int]] = field(default_factory=deque)  # batch, bytes
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
        self, events: Iterable[tuple[str, Event]] | AsyncIterator[Iterable[tuple[str, Event]]]
    ) -> Report:
        """Deliver every ``(session key, event)`` (or every one of each chunk an async iterator
        gives); raises what stopped the destination (``DestinationRefused``) after the sessions
        in flight have ended."""
        try:
            if isinstance(events, AsyncIterator):
                async for chunk in events:
                    for key, event in chunk:
                        if self._add(key, event):
                            await self._wait()
            else:
                for key, event in events:
                    if self._add(key, event):
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

    def _add(self, key: str, event: Event) -> bool:
        """Add one event to its session's buffer; True when the caller must wait for the
        queued batches to drain (backpressure)."""
        if self._error is not None:
            raise self._error
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session(session_name(self.destination, key))
            session.room = self.config.max_batch_bytes - self.format.fixed(session.name)
        cost = self.format.cost(event, first=not session.events)
        if cost > session.room:  # too large for any batch: trimmed, or failed
            fitted = trim(event, session.room, self.format)
            if fitted is None:
                limit = self.config.max_batch_bytes
                reason = f"the event is larger than max_batch_bytes ({limit}) even when trimmed"
                self.report.too_large.append((event, reason))
                return False
            event = fitted
            cost = self.format.cost(event, first=not session.events)
        if session.events and session.size + cost > session.room:
            self._seal(session)
            cost = self.format.cost(event, first=True)
        session.events.append(event)
        session.size += cost
        return self._pending_bytes > self.max_pending_bytes

    async def _wait(self) -> None:
        while self._pending_bytes > self.max_pending_bytes and self._error is None:
            self._drained.clear()
            await self._drained.wait()  # backpressure: stop reading until batches are sent

    def _seal(self, session: _Session) -> None:
        """The buffer becomes the session's next batch; start its sender if idle."""
        if not session.events:
            return
        session.queue.append((session.events, session.size))
        self._pending_bytes += session.size
        session.events, session.size = [], 0
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
