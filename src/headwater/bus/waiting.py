"""Appending that waits on the log's backpressure instead of failing.

A full write queue refuses an append with ``QueueFull`` and queues none of it. The collector
turns that into ``503`` with ``Retry-After`` (its clients retry); every other writer (the command
line, transport readers, webhook workers, replays, the failed store) appends through these
helpers, which wait on the backend's own signal that the queue has room (the embedded log's
writer taking its queue, Kafka's delivery reports) and queue the append then, once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TypeVar

from headwater.bus.base import Bus
from headwater.bus.errors import QueueFull
from headwater.bus.records import Message, Position

T = TypeVar("T")

#: The longest single wait for room, so that a deadline or ``stop`` is seen this soon.
WAIT_SLICE_S = 0.2


def append_waiting(
    bus: Bus,
    topic: str,
    messages: Sequence[Message],
    *,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> Future[Sequence[Position]]:
    """``bus.append(topic, messages)``, waiting for room while the queue is full. Gives up with
    the last ``QueueFull`` at ``deadline`` (``time.monotonic()``; None: never) or once ``stop``
    is set; nothing of the batch is queued then."""
    return _waiting(bus, lambda: bus.append(topic, messages), deadline, stop)


def append_many_waiting(
    bus: Bus,
    batches: Mapping[str, Sequence[Message]],
    *,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> list[Future[Sequence[Position]]]:
    """``bus.append_many(batches)`` (all queued or none), waiting as ``append_waiting`` does."""
    return _waiting(bus, lambda: bus.append_many(batches), deadline, stop)


async def append_many_when_room(
    bus: Bus, batches: Mapping[str, Sequence[Message]]
) -> list[Future[Sequence[Position]]]:
    """``append_many_waiting`` for asyncio code: queued at once when the queue has room, else
    waited for on a worker thread, so that the event loop goes on meanwhile."""
    try:
        return bus.append_many(batches)
    except QueueFull:
        return await asyncio.to_thread(append_many_waiting, bus, batches)


def _waiting(
    bus: Bus,
    attempt: Callable[[], T],
    deadline: float | None,
    stop: threading.Event | None,
) -> T:
    while True:
        try:
            return attempt()
        except QueueFull as full:
            while True:
                left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    raise
                if bus.wait_for_room(full, min(left, WAIT_SLICE_S)):
                    break
