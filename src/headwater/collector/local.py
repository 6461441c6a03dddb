"""Appending encoded batches to the embedded log in this process, from asyncio.

The log's writer thread finishes each append (``writer.Parts``); the finished appends are handed
to the event loop once per group commit (one ``call_soon_threadsafe`` per round, not one per
append), which resolves every request the round made durable.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.writer import Finish, Parts
from headwater.collector.batch import EmbeddedEncoding

if TYPE_CHECKING:
    from headwater.bus.embedded.backend import EmbeddedBus


class _Round:
    """Appends finished on the writer's thread, handed to one event loop once per round."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._finished: list[tuple[asyncio.Future[list[int]], list[int], BaseException | None]]
        self._finished = []

    def finish(self, future: asyncio.Future[list[int]]) -> Finish:
        def finished(bases: list[int], error: BaseException | None) -> None:
            with self._lock:
                self._finished.append((future, bases, error))

        return finished

    def round_end(self) -> None:
        with self._lock:
            finished, self._finished = self._finished, []
        if finished and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_resolve, finished)


def _resolve(
    finished: list[tuple[asyncio.Future[list[int]], list[int], BaseException | None]],
) -> None:
    for future, bases, error in finished:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(bases)


class LocalSink(EmbeddedEncoding):
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
        parts = Parts(len(batches), rnd.finish(future), rnd.round_end)
        self.bus.append_encoded([(t, p, b, parts.part(i)) for i, (t, p, b) in enumerate(batches)])
        return future

    async def room(self, nbytes: int) -> None:
        """The log's writer refuses what its queue cannot take (``BusUnavailable``)."""

    async def partitions(self, topic: str) -> int:
        return self.bus.partitions_for_append(topic)
