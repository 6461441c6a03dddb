"""The request ids a WebSocket connection sent recently, to answer a repeat without storing it
again (Raccoon's ``req_guid`` dedup, per connection).

A request still being stored keeps its outcome (a future the repeat waits on); a stored one is
kept only as a 64-bit hash in a ring of ``window`` slots: 8 bytes per id instead of a dict entry
and the id's string, so that thousands of long-lived connections with a full window stay small
(a hash collision, about 1 in 10^16 per lookup, would answer a new request as a repeat).

A lookup does not compare every hash in Python: each slot also has a one-byte mark (the hash's
low byte) in a parallel ``bytearray``, searched with ``find`` (C's memchr), so only the slots
whose mark matches (about one in 256) are compared: about 1 µs for a full window of 1,024 ids
where comparing them all took 15-25 µs, for one more byte per id.
"""

from __future__ import annotations

import asyncio
from array import array


class RecentRequests:
    __slots__ = ("_done", "_marks", "_next", "_running")

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Future[None]] | None = None
        self._done: array[int] | None = None
        self._marks = bytearray()  # each slot's hash & 0xFF
        self._next = 0  # the ring's slot to overwrite next, once it holds ``window`` hashes

    def running(self, guid: str) -> asyncio.Future[None] | None:
        """The first attempt's outcome while it is being stored."""
        return self._running.get(guid) if self._running else None

    def stored(self, guid: str) -> bool:
        done = self._done
        if done is None:
            return False
        key = hash(guid)
        mark = key & 0xFF
        find = self._marks.find
        slot = find(mark)
        while slot >= 0:
            if done[slot] == key:
                return True
            slot = find(mark, slot + 1)
        return False

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
        key = hash(guid)
        if len(self._done) < window:
            self._done.append(key)
            self._marks.append(key & 0xFF)
        else:
            slot = self._next % window
            self._done[slot] = key
            self._marks[slot] = key & 0xFF
            self._next = (self._next + 1) % window
