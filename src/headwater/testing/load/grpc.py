"""A gRPC load client over one HTTP/2 connection, just big enough to load a server with unary
calls.

The WebSocket and REST load clients send pre-built request bytes over bare transports, so the
load they put on the shared two cores is small; this is the same for gRPC. A call is one HEADERS
frame whose header block is built once (HPACK literals without indexing, so it does not depend on
any table state) and the message in DATA frames; only the stream id changes. The server's header
blocks are decoded with ``hpack`` (the server's encoder indexes, so its table is kept), its
SETTINGS and PINGs are answered, and both directions' flow-control windows are kept:
- what the client sends waits for the server's connection and stream windows;
- the client opens its own windows wide at the start and tops the connection's up.

``GrpcConnection(on_reply)`` is an ``asyncio.Protocol``; ``call(message, token)`` starts a call
and ``on_reply(token, message or None, problem)`` is called once per call: the response message
and "" for status 0, else ``None`` and what went wrong (grpc-status and grpc-message, an HTTP
status, a reset stream, a lost connection).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any, cast

from hpack import Decoder

from headwater.collector.grpc_server import length_prefixed
from headwater.collector.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FRAME_HEAD,
    FRAME_HEAD_SIZE,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    goaway,
    literal,
    parse_settings,
    settings_frame,
    strip_padding,
    u32,
    window_update,
)
from headwater.testing.load.requests import USER_AGENT

OWN_WINDOW = 1 << 30  # the client's receive windows: never in the way

Reply = Callable[[Any, bytes | None, str], None]


def request_block(authority: str, path: str) -> bytes:
    headers = (
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", authority.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"user-agent", USER_AGENT.encode()),
    )
    return b"".join(literal(n, v) for n, v in headers)


# the path of Raccoon's unary call
SEND_EVENT = "/raystack.raccoon.v1beta1.EventService/SendEvent"


class _Call:
    __slots__ = ("body", "headers", "status", "token")

    def __init__(self, token: Any) -> None:
        self.token = token
        self.headers = 0  # header blocks seen
        self.body = bytearray()
        self.status = ""


class GrpcConnection(asyncio.Protocol):
    def __init__(self, authority: str, path: str, on_reply: Reply) -> None:
        self.block = request_block(authority, path)
        self.on_reply = on_reply
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = Decoder()
        self._buffer = bytearray()
        self._calls: dict[int, _Call] = {}
        self._next_stream = 1
        self._max_frame = 16_384
        self._initial_window = DEFAULT_WINDOW  # the server's, for each new stream
        self._window = DEFAULT_WINDOW  # the server's connection window
        self._stream_windows: dict[int, int] = {}
        self._pending: list[tuple[int, memoryview]] = []  # (stream, data) the windows hold back
        self._received = 0  # DATA bytes since the client last opened its connection window
        self._header_stream = 0  # a header block continued in CONTINUATION frames
        self._header_flags = 0
        self._header_block = bytearray()
        self._out: list[bytes] = []  # frames to write, in one write per loop turn

    # -- the connection ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(
            PREFACE
            + settings_frame({ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: OWN_WINDOW})
            + window_update(0, OWN_WINDOW - DEFAULT_WINDOW)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():  # first: the calls failed below start no new ones
            self.lost.set_result(None)
        self._fail_all(f"connection lost: {exc or 'closed by the server'}")
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("the connection closed before SETTINGS"))

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(goaway(0, NO_ERROR))
            self.transport.close()

    # -- calls ------------------------------------------------------------------------------------
    def call(self, message: bytes, token: Any) -> None:
        """Start a unary call with ``message`` (serialized); its reply goes to ``on_reply``."""
        assert self.transport is not None
        stream = self._next_stream
        self._next_stream += 2
        self._calls[stream] = _Call(token)
        self._stream_windows[stream] = self._initial_window
        head = frame(HEADERS, END_HEADERS, stream, self.block)
        data = memoryview(length_prefixed(message))
        if self._pending:  # calls before it wait for a window: it waits behind them
            self._write(head)
            self._pending.append((stream, data))
        elif left := self._send(stream, data, head):
            self._pending.append((stream, left))

    def _send(self, stream: int, data: memoryview, head: bytes = b"") -> memoryview:
        """Send ``head`` and what the windows allow of ``data`` (ending the stream with its
        last byte), in one write; returns what is left."""
        assert self.transport is not None
        out = [head] if head else []
        while data:
            room = min(self._window, self._stream_windows.get(stream, 0), self._max_frame)
            if room <= 0:
                break
            chunk, data = data[:room], data[room:]
            self._window -= len(chunk)
            self._stream_windows[stream] -= len(chunk)
            out.append(frame(DATA, 0 if data else END_STREAM, stream, bytes(chunk)))
        if out:
            self._write(b"".join(out))
        return data

    def _write(self, data: bytes) -> None:
        """Frames go out together once per loop turn, as a gRPC client's transport writes the
        frames of many calls at once."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush_out)
        self._out.append(data)

    def _flush_out(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def _flush_pending(self) -> None:
        while self._pending:
            stream, data = self._pending[0]
            left = self._send(stream, data)
            if left:
                self._pending[0] = (stream, left)
                return
            del self._pending[0]

    def _finish(self, stream: int, problem: str) -> None:
        call = self._calls.pop(stream, None)
        self._stream_windows.pop(stream, None)
        if call is None:
            return
        if any(s == stream for s, _ in self._pending):  # answered before it was all sent
            self._pending = [(s, d) for s, d in self._pending if s != stream]
            self._flush_pending()
        if not problem and call.status != "0":
            problem = f"grpc-status {call.status or '(none)'}"
        message = None
        if not problem:
            body = call.body
            if len(body) < 5 or length_prefixed(bytes(body[5:])) != body:
                problem = "the response is not one uncompressed gRPC message"
            else:
                message = bytes(body[5:])
        self.on_reply(call.token, message, problem)

    def _fail_all(self, problem: str) -> None:
        self._pending.clear()
        for stream in list(self._calls):
            self._finish(stream, problem)

    # -- frames from the server -------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= FRAME_HEAD_SIZE:
            high, low, kind, flags, stream = FRAME_HEAD.unpack_from(buffer, start)
            end = start + FRAME_HEAD_SIZE + (high << 8 | low)
            if len(buffer) < end:
                break
            payload = bytes(buffer[start + FRAME_HEAD_SIZE : end])
            self._frame(kind, flags, stream & MAX_WINDOW, payload)
            start = end
        del buffer[:start]

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        assert self.transport is not None
        if kind == DATA:
            self._received += len(payload)
            payload = strip_padding(flags, payload)
            call = self._calls.get(stream)
            if call is not None:
                call.body += payload
                if flags & END_STREAM:
                    self._finish(stream, "the response ended without trailers")
            if self._received > OWN_WINDOW // 2:
                self._write(window_update(0, self._received))
                self._received = 0
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                payload = strip_padding(flags, payload)
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self._header_stream, self._header_flags = stream, flags
                self._header_block = bytearray(payload)
            else:
                self._header_block += payload
            if flags & END_HEADERS:
                self._headers(self._header_stream, self._header_flags, bytes(self._header_block))
        elif kind == SETTINGS:
            if not flags & ACK:
                for key, value in parse_settings(payload):
                    if key == MAX_FRAME_SIZE:
                        self._max_frame = value
                    elif key == INITIAL_WINDOW_SIZE:
                        delta, self._initial_window = value - self._initial_window, value
                        for s in self._stream_windows:
                            self._stream_windows[s] += delta
                self._write(frame(SETTINGS, ACK, 0))
                if not self.ready.done():
                    self.ready.set_result(None)
                self._flush_pending()
        elif kind == WINDOW_UPDATE:
            increment = u32(payload)
            if stream == 0:
                self._window += increment
            elif stream in self._stream_windows:
                self._stream_windows[stream] += increment
            self._flush_pending()
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            code = u32(payload)
            self._finish(stream, f"the server reset the stream (HTTP/2 error {code})")
        elif kind == GOAWAY:
            last, code = struct.unpack(">II", payload[:8])
            message = payload[8:].decode(errors="replace")
            for s in [s for s in self._calls if s > last & MAX_WINDOW]:
                self._finish(s, f"GOAWAY (HTTP/2 error {code}) {message}".strip())

    def _headers(self, stream: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block, raw=True)  # every block, to keep the table
        call = self._calls.get(stream)
        if call is None:
            return
        call.headers += 1
        values = dict(headers)
        if call.headers == 1 and values.get(b":status", b"200") != b"200":
            self._finish(stream, f"HTTP {values[b':status'].decode()}")
            return
        if b"grpc-status" in values:
            call.status = values[b"grpc-status"].decode()
            if call.status != "0":
                detail = values.get(b"grpc-message", b"").decode(errors="replace")
                self._finish(stream, f"grpc-status {call.status}: {detail}")
                return
        if flags & END_STREAM:
            self._finish(stream, "")
