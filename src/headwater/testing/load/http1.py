"""A keep-alive HTTP/1.1 load client: Raccoon REST requests (``POST /api/v1/events``,
``application/proto``) from one pre-built head and template, one request in flight per
connection, the next sent as soon as the last is answered."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import cast

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
