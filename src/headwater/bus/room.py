"""Room for bytes on their way to a log, handed out in turn (backpressure without refusals).

A writer that answers requests once their bytes are durable (the collector's link to the
process holding the embedded log, headwater's Kafka producer) holds only so many bytes at once.
A request asks ``wait(nbytes)`` before it appends: it gets the room at once when the bytes
fit and nobody waits before it, else it waits in turn, first come, first served, so that under
load no request waits while later ones pass it. The room granted is held for the append that
follows (``take``), and given back when the log answers (``release``).
"""

from __future__ import annotations

import asyncio
import collections


class Room:
    """``limit`` bytes, taken by appends and released by answers; an empty room takes an
    append of any size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # taken by appends, not released yet
        self._promised = 0  # granted by ``wait``, not taken yet
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def fits(self, nbytes: int) -> bool:
        held = self.used + self._promised
        return held == 0 or held + nbytes <= self.limit

    async def wait(self, nbytes: int, timeout_s: float, *, hold: bool = True) -> bool:
        """Wait in turn until ``nbytes`` fit, then hold them for the ``take`` that follows
        (``hold=False``: only wait). False when no room came within ``timeout_s``."""
        if not self._waiting and self.fits(nbytes):
            if hold:
                self._promised += nbytes
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            if waiter.done() and waiter.exception() is None:  # granted as the wait ended
                self._give_back(nbytes)
            return False
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)
        if not hold:
            self._give_back(nbytes)
        return True

    def take(self, nbytes: int) -> None:
        """An append of ``nbytes`` (room granted by ``wait`` or not)."""
        self._promised = max(0, self._promised - nbytes)
        self.used += nbytes

    def release(self, nbytes: int) -> None:
        """The log answered ``nbytes``: their room goes to the next in turn."""
        self.used -= nbytes
        self._grant()

    def fail(self, error: BaseException) -> None:
        """Every request waiting gets ``error`` (the log has gone)."""
        for _, waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(error)

    def _give_back(self, nbytes: int) -> None:
        self._promised = max(0, self._promised - nbytes)
        self._grant()

    def _grant(self) -> None:
        waiting = self._waiting
        while waiting:
            nbytes, waiter = waiting[0]
            if waiter.done():
                waiting.popleft()
                continue
            if not self.fits(nbytes):
                return
            waiting.popleft()
            self._promised += nbytes
            waiter.set_result(None)
