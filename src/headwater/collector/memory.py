"""Memory habits of the intake processes (and of the process running the webhook workers,
which paces its GC the same way): the C heap's free pages, and the cyclic GC's pace.

glibc keeps memory freed in the middle of its heap; ``malloc_trim`` returns those pages. The
intake processes call it after start-up and whenever their shared ring goes idle: a burst of
large request buffers otherwise stays resident after it has been freed, in every worker.

An intake process frees almost everything it makes by reference counting (a request's events,
its buffers, its futures) and holds thousands of requests in flight. At Python's default pace
(a young collection every 700 net allocations of containers) the collector walked those
requests hundreds of times a second: 19-22% of an intake loop at 100 WebSocket connections
(2026-11-29). ``pace_gc`` makes young collections rare; reference cycles are still collected,
later. The process holding the log paces its GC the same way (``paced``, at the server roles'
entry points): its webhook workers make and free thousands of tasks, futures and states a
message, and at the default pace ran 1,766 messages/s end to end, 2,016 paced (2026-11-29).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Awaitable
from typing import Any, TypeVar

_LIBC: Any = None


def trim_heap() -> None:
    """``malloc_trim(0)`` where glibc has it; nothing elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - present in glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


# Net container allocations between young collections, then young collections per older one
# (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (50_000, 5, 10)
# A young collection this often whatever the count, so that garbage in cycles (a closed
# connection's objects) does not linger in a quiet process: 3.1 kB an idle WebSocket at the
# default pace, 7.9 kB at the slow one without it (2026-11-29, 2,000 connections).
YOUNG_COLLECTION_S = 1.0


def pace_gc(loop: asyncio.AbstractEventLoop) -> None:
    """Set the intake process's collector thresholds (``GC_THRESHOLDS``) and collect the young
    generation every ``YOUNG_COLLECTION_S`` on ``loop``."""
    gc.set_threshold(*GC_THRESHOLDS)

    def collect() -> None:
        gc.collect(0)
        loop.call_later(YOUNG_COLLECTION_S, collect)

    loop.call_later(YOUNG_COLLECTION_S, collect)


T = TypeVar("T")


async def paced(main: Awaitable[T]) -> T:
    """Run ``main`` (a server process's whole life) with the GC paced as ``pace_gc`` does, what
    start-up made frozen out of the collector's walks."""
    gc.collect()
    gc.freeze()
    pace_gc(asyncio.get_running_loop())
    return await main
