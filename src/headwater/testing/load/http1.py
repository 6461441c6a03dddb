"""HTTP/1.1 load clients: ``HttpClient``, Raccoon REST requests (``POST /api/v1/events``,
``application/proto``) from one pre-built head and template on a keep-alive connection, one
request in flight, the next sent as soon as the last is answered; ``post_concurrently``, any
bodies POSTed by concurrent workers over one aiohttp session; ``HttpConnection``, a keep-alive
connection on asyncio streams that awaits each answer (its client port known); and
``request_bytes``, the bytes of one request."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from headwater.collector.protocols import raccoon
from headwater.testing.clients import (
    RawResponse,
    close_writer,
    raccoon_request,
    raccoon_response,
    read_response,
)
from headwater.testing.load.requests import USER_AGENT, Guids, Stats, reply_problem, with_guid

CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def post_head(host: str, port: int, path: str, content_type: str, length: int) -> bytes:
    """The head of a keep-alive ``POST`` of ``length`` bytes."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nUser-Agent: {USER_AGENT}\r\n\r\n"
    ).encode()


@dataclass
class HttpLoad:
    tag: str
    head: bytes
    template: bytes
    stats: Stats = field(default_factory=Stats)
    sending: bool = False


class HttpClient(asyncio.Protocol):
    """One keep-alive connection with one POST in flight at a time."""

    def __init__(self, load: HttpLoad, index: int) -> None:
        self.load = load
        self.guids = Guids(f"{load.tag}-{index:06d}-")
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self._status = 0
        self._length: int | None = None
        self._guid = b""
        self._sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def send_request(self) -> None:
        assert self.transport is not None
        self._guid = self.guids.next()
        self._sent_at = time.perf_counter()
        self.transport.write(self.load.head + with_guid(self.load.template, self._guid))
        self.load.stats.sent += 1

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            if self._length is None:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buffer[:end])
                del buffer[: end + 4]
                self._status = int(head[9:12])
                found = CONTENT_LENGTH.search(head)
                self._length = int(found.group(1)) if found else 0
            if len(buffer) < self._length:
                return
            body = bytes(buffer[: self._length])
            del buffer[: self._length]
            self._length = None
            self._response(body)

    def _response(self, body: bytes) -> None:
        problem = reply_problem(body, self._guid)
        if self._status != 200 and not problem:
            problem = f"HTTP {self._status}"
        self.load.stats.answered(problem, self._sent_at, f"HTTP {self._status}: ")
        if self.load.sending:
            self.send_request()


async def post_concurrently(
    url: str,
    bodies: Iterable[tuple[bytes, Mapping[str, str]]],
    concurrency: int,
    expect: int | None = None,
) -> float:
    """POST each (body, headers) of ``bodies`` to ``url``, ``concurrency`` requests in flight
    over one aiohttp session with no connection limit; the seconds it took. ``expect``: the
    status every answer must have (``AssertionError`` otherwise)."""
    import aiohttp

    queue = iter(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            for body, headers in queue:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    assert expect is None or r.status == expect, (r.status, url)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def request_bytes(
    host: str,
    method: str,
    path: str,
    body: bytes = b"",
    content_type: str = "application/proto",
    extra: str = "",
    *,
    close: bool = False,
) -> bytes:
    """An HTTP/1.1 request: ``host`` as its Host, ``extra`` header lines (each ending in CRLF)
    after the content headers, ``Connection: close`` when ``close``."""
    connection = "Connection: close\r\n" if close else ""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n{connection}{extra}\r\n"
    )
    return head.encode() + body


class HttpConnection:
    """One keep-alive HTTP/1.1 connection on raw streams, one request at a time."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        host: str,
        timeout: float,
        event_type: str,
    ) -> None:
        self.reader, self.writer = reader, writer
        self.host, self.timeout, self.event_type = host, timeout, event_type
        self.port: int = writer.get_extra_info("sockname")[1]  # the client's port

    @classmethod
    async def open(
        cls, host: str, port: int, *, timeout: float = 10.0, event_type: str = "click"
    ) -> HttpConnection:
        """A connection to ``host:port``; each answer awaited ``timeout`` seconds at most;
        ``event_type``: the Raccoon events' type ``post`` sends."""
        return cls(*await asyncio.open_connection(host, port), host, timeout, event_type)

    async def request(self, method: str, path: str, body: bytes = b"") -> RawResponse:
        """The answer (``OSError`` when the connection fails first)."""
        self.writer.write(request_bytes(self.host, method, path, body))
        await self.writer.drain()
        response = await read_response(self.reader, self.timeout)
        if response is None:
            raise ConnectionResetError(f"no answer to {method} {path}")
        return response

    async def post(self, guid: str, values: Sequence[bytes], event_type: str | None = None) -> bool:
        """A Raccoon REST batch of ``values`` (of ``event_type``, default the connection's);
        True once acked."""
        kind = event_type or self.event_type
        body = raccoon_request(guid, [(kind, v) for v in values])
        r = await self.request("POST", "/api/v1/events", body)
        return r.status == 200 and raccoon_response(r.body).status == raccoon.Status.SUCCESS

    async def metrics(self) -> str:
        r = await self.request("GET", "/metrics")
        assert r.status == 200, r
        return r.body.decode()

    async def close(self) -> None:
        await close_writer(self.writer)
