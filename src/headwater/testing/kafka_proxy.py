"""A TCP relay in front of a Kafka broker that loses answers, for tests of producers.

``KafkaProxy`` relays every byte both ways and follows the request frames, so it knows which
answer belongs to which request. ``lose_produce_answers(n)`` makes it swallow the next ``n``
answers to Produce requests: the broker has acted on the request (the records are stored), and
the connection drops before the producer hears so. That is the case idempotence exists for: the
producer must send the batch again and the broker must store it once::

    proxy = KafkaProxy("127.0.0.1", broker_port)
    await proxy.start()
    sender.route = proxy.route          # connect through it
    proxy.lose_produce_answers(3)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct

_SIZE = struct.Struct(">i")
_API_KEY = struct.Struct(">h")
PRODUCE = 0


class KafkaProxy:
    """Relays connections to ``host:port`` (a broker) from a port of its own."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.lost = 0  # answers swallowed so far
        self.connections = 0
        self._to_lose = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def route(self, host: str, port: int) -> tuple[str, int]:
        """For ``KafkaSender.route``: every broker is reached through this proxy (one broker)."""
        return "127.0.0.1", self.port

    def lose_produce_answers(self, n: int) -> None:
        self._to_lose += n

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for w in list(self._writers):
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        try:
            broker_r, broker_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self._writers.add(broker_w)
        pending: collections.deque[int] = collections.deque()  # api keys of unanswered requests
        up = asyncio.ensure_future(self._requests(client_r, broker_w, pending))
        down = asyncio.ensure_future(self._answers(broker_r, client_w, pending))
        self._tasks |= {up, down}
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                self._tasks.discard(task)
            for w in (client_w, broker_w):
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()
                self._writers.discard(w)

    async def _requests(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, pending: collections.deque[int]
    ) -> None:
        while True:
            frame = await _frame(r)
            if frame is None:
                return
            pending.append(_API_KEY.unpack_from(frame, 4)[0])
            w.write(frame)
            await w.drain()

    async def _answers(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, pending: collections.deque[int]
    ) -> None:
        while True:
            frame = await _frame(r)
            if frame is None or not pending:
                return
            if pending.popleft() == PRODUCE and self._to_lose > 0:
                self._to_lose -= 1
                self.lost += 1
                return  # the broker stored it; the producer never hears: drop the connection
            w.write(frame)
            await w.drain()


async def _frame(r: asyncio.StreamReader) -> bytes | None:
    try:
        head = await r.readexactly(4)
        (size,) = _SIZE.unpack(head)
        return head + await r.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
