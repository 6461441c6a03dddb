"""Small clients for tests that talk to the collector over raw sockets.

- ``raccoon_request``/``raccoon_response``: Raccoon ``SendEventRequest`` bytes and a parsed
  ``SendEventResponse``.
- ``RawWebSocket``: a minimal RFC 6455 client on asyncio streams that can send any frame,
  including ones a real client library refuses to (bad opcodes, reserved bits, unmasked frames,
  invalid UTF-8 text, lying lengths), and read the server's frames back.
- ``http_exchange``: send raw bytes to an HTTP server and read one response, if any, within a
  deadline.

The load clients (a keep-alive connection, many requests in flight, pre-built bytes) are in
``headwater.testing.load``.

Everything here is bounded in time: every read takes a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from headwater.collector.protocols import raccoon

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA


def raccoon_request(req_guid: str, events: Sequence[tuple[str, bytes]]) -> bytes:
    """A binary ``SendEventRequest`` carrying ``events`` as (type, bytes) pairs."""
    req: Any = raccoon.SendEventRequest(req_guid=req_guid)
    for event_type, data in events:
        req.events.add(type=event_type, event_bytes=data)
    out: bytes = req.SerializeToString()
    return out


def raccoon_response(data: bytes) -> Any:
    """A binary ``SendEventResponse`` parsed."""
    resp: Any = raccoon.SendEventResponse()
    resp.ParseFromString(data)
    return resp


# -- HTTP -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # lowercase names
    body: bytes


class HandshakeFailed(Exception):
    def __init__(self, response: RawResponse | None) -> None:
        super().__init__(f"WebSocket handshake refused: {response}")
        self.response = response


async def read_response(reader: asyncio.StreamReader, timeout: float) -> RawResponse | None:
    """One HTTP/1.1 response from ``reader`` (body by Content-Length, else up to EOF); None when
    the connection ends before a whole head arrives or nothing comes within ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return RawResponse(0, {}, head)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    status = int(parts[1])
    body = b""
    left = max(0.0, deadline - loop.time())
    with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, OSError, ValueError):
        if status == 101:
            pass
        elif "content-length" in headers:
            body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), left)
        elif headers.get("connection", "").lower() == "close":
            body = await asyncio.wait_for(reader.read(), left)
    return RawResponse(status, headers, body)


async def http_exchange(
    host: str, port: int, data: bytes, timeout: float, *, half_close: bool = False
) -> RawResponse | None:
    """Send ``data`` on a new connection and read one response (None: the server closed the
    connection without one, or sent nothing within ``timeout``). ``half_close`` shuts the
    sending side after ``data``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        if half_close and writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await read_response(reader, timeout)
    finally:
        await close_writer(writer)


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


# -- WebSocket ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    fin: bool
    opcode: int
    payload: bytes

    @property
    def close_code(self) -> int | None:
        if self.opcode != OP_CLOSE or len(self.payload) < 2:
            return None
        code: int = struct.unpack("!H", self.payload[:2])[0]
        return code


def encode_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bool = True,
    length: int | None = None,
    key: bytes | None = None,
) -> bytes:
    """A WebSocket frame as a client sends it; ``length`` overrides the declared length, ``key``
    is the masking key (default: a random one)."""
    first = (0x80 if fin else 0) | (rsv & 0x7) << 4 | (opcode & 0xF)
    n = len(payload) if length is None else length
    bit = 0x80 if mask else 0
    if n < 126:
        head = struct.pack("!BB", first, bit | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", first, bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, bit | 127, n)
    if not mask:
        return head + payload
    key = key or os.urandom(4)
    return head + key + apply_mask(payload, key)


def apply_mask(payload: bytes, key: bytes) -> bytes:
    if not payload:
        return b""
    repeated = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
        len(payload), "big"
    )


class RawWebSocket:
    """A WebSocket client connection on asyncio streams, with no protocol checks of its own."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        path: str = "/api/v1/events",
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        after_get: str | None = None,
        early: bytes = b"",
        tls: ssl.SSLContext | None = None,
    ) -> RawWebSocket:
        """Open a connection and complete the upgrade; ``HandshakeFailed`` when refused. With
        ``after_get``, the upgrade is the connection's second request, after a GET of that path
        (answered 200); ``early`` is written in the same write as the handshake; ``tls``: over
        TLS with this client context."""
        reader, writer = await asyncio.open_connection(host, port, ssl=tls)
        if after_get is not None:
            writer.write(f"GET {after_get} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            answer = await read_response(reader, timeout)
            if answer is None or answer.status != 200:
                await close_writer(writer)
                raise HandshakeFailed(answer)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + early)
        response = await read_response(reader, timeout)
        if response is None or response.status != 101:
            await close_writer(writer)
            raise HandshakeFailed(response)
        return cls(reader, writer)

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send_frame(self, opcode: int, payload: bytes, **kwargs: Any) -> None:
        self.writer.write(encode_frame(opcode, payload, **kwargs))

    async def drain(self) -> None:
        await self.writer.drain()

    async def recv_frame(self, timeout: float) -> Frame | None:
        """The server's next frame; None at end of stream. ``TimeoutError`` past ``timeout``."""
        return await asyncio.wait_for(self._read_frame(), timeout)

    async def recv_data(self, timeout: float) -> Frame | None:
        """The next data or close frame (pings are answered, pongs skipped); None at EOF."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            frame = await self.recv_frame(max(0.0, deadline - loop.time()))
            if frame is None or frame.opcode not in (OP_PING, OP_PONG):
                return frame
            if frame.opcode == OP_PING:
                self.send_frame(OP_PONG, frame.payload)

    async def _read_frame(self) -> Frame | None:
        try:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
            key = await self.reader.readexactly(4) if b1 & 0x80 else b""
            payload = await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        if key:
            payload = apply_mask(payload, key)
        return Frame(bool(b0 & 0x80), b0 & 0x0F, payload)

    async def close(self) -> None:
        await close_writer(self.writer)
