"""The request deadline (``collector.limits.request_timeout_s``) for HTTP clients.

aiohttp's server waits for a request head as long as the connection stays open, so a client that
sends half a head and stops (slowloris) would hold its connection forever. ``HeadDeadline`` wraps
each connection's protocol: the first bytes of a request start a timer, the request reaching the
handler stops it, and a timer that fires answers ``408 Request Timeout`` and closes the
connection. The body's deadline is the handler's (``asyncio.timeout`` around the read).

The wrapper also lets the server take a connection before aiohttp sees it (``upgrade``: the
collector's own WebSocket connections): aiohttp's handler is made only for a connection the
server leaves to HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

from aiohttp.web_protocol import RequestHandler

#: Looks at the first bytes of a connection: None, more are needed; False, leave it to HTTP;
#: True, taken (the transport has a protocol of the server's now).
Upgrade = Callable[[bytes, asyncio.Transport], bool | None]

_TIMEOUT_BODY = b"the request was not sent in time (collector.limits.request_timeout_s)\n"
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class HeadDeadline:
    """Tracks which connections are inside a request and times the heads of the others."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._busy: set[Hashable] = set()

    def factory(
        self, make: Callable[[], RequestHandler], upgrade: Upgrade
    ) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's ``make``; ``upgrade``
        may take a connection from its first bytes."""
        return lambda: _TimedProtocol(self, make, upgrade)

    def begin(self, handler: RequestHandler) -> None:
        """A request's head has arrived at the handler: its connection is no longer timed."""
        timer = self._timers.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._busy.add(handler)

    def end(self, handler: RequestHandler) -> None:
        self._busy.discard(handler)

    def _data(self, handler: Hashable, transport: asyncio.BaseTransport | None) -> None:
        if handler in self._busy or handler in self._timers or transport is None:
            return
        loop = asyncio.get_running_loop()
        self._timers[handler] = loop.call_later(self.timeout_s, self._fire, handler, transport)

    def _fire(self, handler: Hashable, transport: asyncio.BaseTransport) -> None:
        self._timers.pop(handler, None)
        if handler in self._busy or transport.is_closing():
            return
        self._on_timeout()
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(TIMEOUT_RESPONSE)
        transport.close()

    def _gone(self, handler: Hashable) -> None:
        timer = self._timers.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._busy.discard(handler)


class _TimedProtocol(asyncio.Protocol):
    """Passes every event to aiohttp's handler, noting the data that starts a request. Until
    ``upgrade`` has decided, the first bytes are held (and timed) here and no handler exists."""

    __slots__ = ("_deadline", "_handler", "_head", "_make", "_transport", "_upgrade")

    def __init__(
        self,
        deadline: HeadDeadline,
        make: Callable[[], RequestHandler],
        upgrade: Upgrade,
    ) -> None:
        self._deadline = deadline
        self._make = make
        self._upgrade = upgrade
        self._handler: RequestHandler | None = None  # made once the first bytes are HTTP's
        self._transport: asyncio.BaseTransport | None = None
        self._head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            assert self._transport is not None
            head = self._head = self._head + data
            taken = self._upgrade(head, self._transport)  # type: ignore[arg-type]
            if taken is None:  # not decided yet: this head is timed like any other
                self._deadline._data(self, self._transport)
                return
            self._deadline._gone(self)
            self._head = b""
            if taken:
                return
            handler = self._handler = self._make()
            handler.connection_made(self._transport)
            data = head
        self._deadline._data(handler, self._transport)
        handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._handler is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline._gone(self)
        if self._handler is not None:
            self._deadline._gone(self._handler)
            self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()
