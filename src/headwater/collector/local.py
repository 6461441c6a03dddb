"""Appending encoded batches to the embedded log in this process, from asyncio.

The log's writer thread tells each batch's ``Done``; here those answers are gathered and handed
to the event loop once per group commit (one ``call_soon_threadsafe`` per round, not one per
append), which resolves every request the round made durable.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from headwater.bus.embedded import format as fmt

if TYPE_CHECKING:
    from headwater.bus.embedded.backend import EmbeddedBus


class _Round:
    """Answers gathered on the writer's thread for one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._answers: list[tuple[_Append, int, int, BaseException | None]] = []

    def add(self, append: _Append, i: int, base: int, error: BaseException | None) -> None:
        with self._lock:
            self._answers.append((append, i, base, error))

    def round_end(self) -> None:
        with self._lock:
            answers, self._answers = self._answers, []
        if answers and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_resolve, answers)


class _Append:
    __slots__ = ("bases", "error", "future", "left")

    def __init__(self, future: asyncio.Future[list[int]], n: int) -> None:
        self.future = future
        self.bases = [-1] * n
        self.left = n
        self.error: BaseException | None = None


class _Part:
    __slots__ = ("append", "i", "round", "round_end")

    def __init__(self, rnd: _Round, append: _Append, i: int) -> None:
        self.round = rnd
        self.append = append
        self.i = i
        self.round_end = rnd.round_end

    def __call__(self, base: int, error: BaseException | None) -> None:
        self.round.add(self.append, self.i, base, error)


def _resolve(answers: list[tuple[_Append, int, int, BaseException | None]]) -> None:
    for append, i, base, error in answers:
        append.bases[i] = base
        append.error = append.error or error
        append.left -= 1
        if append.left == 0 and not append.future.done():
            if append.error is not None:
                append.future.set_exception(append.error)
            else:
                append.future.set_result(append.bases)


class LocalSink:
    """A ``LogSink`` over an ``EmbeddedBus`` open in this process."""

    def __init__(self, bus: EmbeddedBus) -> None:
        self.bus = bus
        self._rounds: dict[asyncio.AbstractEventLoop, _Round] = {}

    def append(
        self, batches: list[tuple[str, int | None, fmt.EncodedBatch]]
    ) -> asyncio.Future[list[int]]:
        loop = asyncio.get_running_loop()
        rnd = self._rounds.get(loop)
        if rnd is None:
            self._rounds = {k: v for k, v in self._rounds.items() if not k.is_closed()}
            rnd = self._rounds[loop] = _Round(loop)
        future: asyncio.Future[list[int]] = loop.create_future()
        append = _Append(future, len(batches))
        self.bus.append_encoded(
            [(t, p, b, _Part(rnd, append, i)) for i, (t, p, b) in enumerate(batches)]
        )
        return future

    async def room(self, nbytes: int) -> None:
        """The log's writer refuses what its queue cannot take (``BusUnavailable``)."""

    async def partitions(self, topic: str) -> int:
        return self.bus.partitions_for_append(topic)
