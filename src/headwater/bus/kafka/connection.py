"""One TCP connection to a Kafka broker, on asyncio: requests pipelined, answers in order.

Kafka answers a connection's requests in the order they were sent, each with the correlation id
it was given; ``Connection`` keeps the requests in flight in a queue and matches every answer
to the oldest, checking its id. A request not answered within its timeout, a malformed frame or
an answer out of order closes the connection, and every request still in flight on it fails with
``ConnectionLost`` (whether the broker acted on them is then unknown).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from typing import NamedTuple

from headwater.bus.kafka.protocol import api
from headwater.bus.kafka.protocol.codec import INT32, ProtocolError

# A frame larger than this is not a response we asked for (a metadata response of thousands of
# topics stays far below): the peer is not a Kafka broker, or the stream is out of step.
MAX_FRAME_BYTES = 256 << 20


class ConnectionLost(ConnectionError):
    """The connection closed, or was closed, before the request was answered."""


class _InFlight(NamedTuple):
    correlation_id: int
    future: asyncio.Future[bytes]
    timer: asyncio.TimerHandle


class Connection(asyncio.Protocol):
    """A connection to ``host:port``; ``open`` connects and learns the API versions served."""

    def __init__(self, host: str, port: int, client_id: str, timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.served: dict[int, tuple[int, int]] = {}
        self.versions: dict[int, int] = {}
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self._made: asyncio.Future[None] = self._loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._buffer = bytearray()
        self._next_id = 0
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        client_id: str,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Connection:
        """Connect and negotiate versions (``api.UnsupportedBroker`` when none fit)."""
        loop = asyncio.get_running_loop()
        conn = cls(host, port, client_id, timeout_s)
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await loop.create_connection(lambda: conn, host, port, ssl=ssl_context)
                    await conn._made  # uvloop calls connection_made after create_connection
                    body = await conn.request(api.API_VERSIONS, 0, api.api_versions_request())
            except TimeoutError:
                raise ConnectionLost(
                    f"broker {host}:{port} did not answer in {timeout_s:.0f} s"
                ) from None
            except OSError as e:
                raise ConnectionLost(f"cannot connect to broker {host}:{port}: {e}") from e
            error, served = api.api_versions_response(body)
            if error:
                raise api.UnsupportedBroker(
                    f"broker {host}:{port} refused ApiVersions (error {error})"
                )
            conn.served = served
            conn.versions = {key: api.choose_version(key, served) for key in api.SPOKEN}
        except (ConnectionLost, ProtocolError):
            conn.close()
            with contextlib.suppress(BaseException):  # the socket is closed before we raise
                await asyncio.wait_for(asyncio.shield(conn.closed), 1.0)
            raise
        except BaseException:  # cancelled while connecting: leave no transport open
            conn.close()
            raise
        return conn

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport
        if not self._made.done():
            self._made.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            (size,) = INT32.unpack_from(buf, pos)
            if not 4 <= size <= MAX_FRAME_BYTES:
                self._abort(ProtocolError(f"broker {self.address} sent a frame of {size} bytes"))
                return
            if end - pos - 4 < size:
                break
            (cid,) = INT32.unpack_from(buf, pos + 4)
            body = bytes(buf[pos + 8 : pos + 4 + size])
            pos += 4 + size
            if not self._inflight or self._inflight[0].correlation_id != cid:
                self._abort(
                    ProtocolError(f"broker {self.address} answered request {cid}, not in order")
                )
                return
            done = self._inflight.popleft()
            done.timer.cancel()
            if not done.future.done():
                done.future.set_result(body)
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        error = self._error or ConnectionLost(
            f"the connection to broker {self.address} closed"
            + (f": {exc}" if exc is not None else "")
        )
        self._error = error
        self._transport = None
        while self._inflight:
            item = self._inflight.popleft()
            item.timer.cancel()
            if not item.future.done():
                item.future.set_exception(error)
        if not self._made.done():
            self._made.set_exception(error)
        if not self.closed.done():
            self.closed.set_result(None)

    # -- requests ---------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self._transport is not None and self._error is None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def request(self, api_key: int, version: int, body: list[bytes]) -> asyncio.Future[bytes]:
        """Send a request now; its answer's body (after the correlation id)."""
        future: asyncio.Future[bytes] = self._loop.create_future()
        if not self.usable:
            future.set_exception(
                self._error or ConnectionLost(f"the connection to broker {self.address} is closed")
            )
            return future
        assert self._transport is not None
        self._next_id = cid = (self._next_id + 1) & 0x7FFFFFFF
        self._transport.writelines(api.frame(api_key, version, cid, self.client_id, body))
        timer = self._loop.call_later(self.timeout_s, self._timed_out, cid)
        self._inflight.append(_InFlight(cid, future, timer))
        return future

    def _timed_out(self, cid: int) -> None:
        self._abort(
            ConnectionLost(
                f"broker {self.address} did not answer request {cid} in {self.timeout_s:.0f} s"
            )
        )

    def _abort(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._transport is not None:
            self._transport.abort()  # connection_lost fails what is in flight

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
