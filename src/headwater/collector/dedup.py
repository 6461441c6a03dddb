"""The request ids a WebSocket connection sent recently, to answer a repeat without storing it
again (Raccoon's ``req_guid`` dedup, per connection).

A request still being stored keeps its outcome (a future the repeat waits on); a stored one is
kept only as a 64-bit hash in a ring of ``window`` slots: 8 bytes per id instead of a dict entry
and the id's string, so that thousands of long-lived connections with a full window stay small
(a hash collision, about 1 in 10^16 per lookup, would answer a new request as a repeat).
"""

from __future__ import annotations

import asyncio
from array import array


class RecentRequests:
    __slots__ = ("_done", "_next", "_running")

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Future[None]] | None = None
        self._done: array[int] | None = None
        self._next = 0  # the ring's slot to overwrite next, once it holds ``window`` hashes

    def running(self, guid: str) -> asyncio.Future[None] | None:
        """The first attempt's outcome while it is being stored."""
        return self._running.get(guid) if self._running else None

    def stored(self, guid: str) -> bool:
        return self._done is not None and hash(guid) in self._done

    def start(self, guid: str, outcome: asyncio.Future[None]) -> None:
        if self._running is None:
            self._running = {}
        self._running[guid] = outcome

    def end(self, guid: str, *, stored: bool, window: int) -> None:
        """The first attempt is over: remember it when it was stored (a failed request may be
        sent again)."""
        if self._running is not None:
            self._running.pop(guid, None)
            if not self._running:
                self._running = None
        if not stored:
            return
        if self._done is None:
            self._done = array("q")
        if len(self._done) < window:
            self._done.append(hash(guid))
        else:
            self._done[self._next % window] = hash(guid)
            self._next = (self._next + 1) % window
