"""The collector's own WebSocket connections (RFC 6455, permessage-deflate from RFC 7692).

A connection whose first request is a WebSocket upgrade to the Raccoon path never reaches
aiohttp: ``take_upgrade`` reads the request head off the socket, the ``websockets`` library
checks the handshake and negotiates the extensions, and the connection's transport is handed to
a ``WebSocket``. An idle connection then holds its transport, this protocol object and the
server's per-connection state: no parsed request, HTTP parser, queue or task per connection
(aiohttp holds ~10 kB of those for a WebSocket's whole life; ``docs/benchmarks.md``). An
upgrade that aiohttp parsed (a later request on a kept-alive connection) is checked by the same
``handshake`` and its connection handed to a ``WebSocket`` too, so every WebSocket connection is
served here.

``Frames`` parses what a client sends; every protocol violation fails the connection with the
close code RFC 6455 gives it: 1002 (protocol error: an unmasked frame, a reserved bit or opcode,
a length not in its shortest form, a bad continuation, a large or fragmented control frame, a
bad close frame), 1007 (text or a close reason that is not UTF-8, a compressed message that does
not inflate) or 1009 (a message over the size limit, also once inflated). A failed connection
sends its close frame, shuts its sending side and drops what the client still sends until the
client closes, so that the close frame is read rather than lost to a reset
(``tests/collector/test_websocket_conformance.py`` holds the RFC's cases).
Frames the server sends are never compressed (allowed under permessage-deflate: answers are small),
so a connection keeps no compressor.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import zlib

from websockets.exceptions import PayloadTooBig, ProtocolError
from websockets.extensions.base import Extension
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the wheels ship the C speedups
    from websockets.utils import apply_mask

CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
PROTOCOL_ERROR, INVALID_DATA, TOO_BIG = 1002, 1007, 1009
MAX_HEAD_BYTES = 32 * 1024  # a longer upgrade head is left to aiohttp (and its limits)
CLOSE_TIMEOUT_S = 10.0  # how long a close waits for the client's close frame
_DEFLATE = ServerPerMessageDeflateFactory(server_no_context_takeover=True)
# the handshake's checker logs "connection open" per connection at INFO: only its warnings
_HANDSHAKE_LOG = logging.getLogger(__name__ + ".handshake")
_HANDSHAKE_LOG.setLevel(logging.WARNING)
_LEN16 = struct.Struct("!H")
_LEN64 = struct.Struct("!Q")


# -- the handshake --------------------------------------------------------------------------
class Upgrade:
    """An accepted handshake: the 101 response to send, the request's headers (lower-case
    names, the last of repeated ones, values decoded as UTF-8 like aiohttp does), the
    extensions in use, and the bytes the client sent after its head."""

    __slots__ = ("extensions", "headers", "response", "rest")

    def __init__(
        self, response: bytes, headers: dict[str, str], extensions: list[Extension], rest: bytes
    ) -> None:
        self.response = response
        self.headers = headers
        self.extensions = extensions
        self.rest = rest


def take_upgrade(head: bytes, path: str) -> Upgrade | bool | None:
    """Decide from the first bytes of a connection: None, more bytes are needed; False, not a
    valid WebSocket upgrade to ``path`` (HTTP serves it, and answers a bad handshake); else the
    accepted ``Upgrade``."""
    prefix = b"GET " + path.encode()
    start = head[: len(prefix) + 1]
    if not (prefix + b" ").startswith(start) and not (prefix + b"?").startswith(start):
        return False
    end = head.find(b"\r\n\r\n")
    if end < 0:
        return None if len(head) <= MAX_HEAD_BYTES else False
    answer = handshake(head[: end + 4], head[end + 4 :])
    return answer if isinstance(answer, Upgrade) else False


def handshake(head: bytes, rest: bytes = b"") -> Upgrade | Response | None:
    """Check a whole request head as a WebSocket handshake: the accepted ``Upgrade`` (``rest``
    is what the client sent after the head), the response that refuses it (400, 426 or 505, with
    the reason as its body), or None when the head is not a request without a body."""
    protocol = ServerProtocol(extensions=[_DEFLATE], max_size=None, logger=_HANDSHAKE_LOG)
    protocol.receive_data(head)
    events = protocol.events_received()
    if not events or not isinstance(events[0], Request):
        return None
    request = events[0]
    if "content-length" in request.headers or "transfer-encoding" in request.headers:
        return None  # (a GET with a body)
    response = protocol.accept(request)
    if response.status_code != 101:
        return response
    protocol.send_response(response)
    headers = {
        name.lower(): value.encode("latin-1", "surrogateescape").decode("utf-8", "surrogateescape")
        for name, value in request.headers.raw_items()
    }
    return Upgrade(b"".join(protocol.data_to_send()), headers, protocol.extensions, rest)


# -- frames ---------------------------------------------------------------------------------
class Failure(Exception):
    """The client broke the protocol: the connection is closed with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Frames:
    """The client's frames, parsed: complete messages (``bytes`` for binary, ``str`` for text)
    and control frames, as ``(opcode, payload)``. Holds nothing between frames but a partial
    frame's bytes and a fragmented message's parts."""

    __slots__ = ("_chunks", "_deflate", "_have", "_max", "_need", "_opcode", "_parts", "_size")

    def __init__(self, max_message_bytes: int, extensions: list[Extension]) -> None:
        self._max = max_message_bytes
        self._deflate = extensions[0] if extensions else None
        self._chunks: list[bytes] = []  # bytes of a frame not complete yet
        self._have = 0
        self._need = 0  # bytes a complete frame needs, once its head is known
        self._opcode = 0  # the opcode of a fragmented message in progress, 0 for none
        self._parts: list[bytes] = []
        self._size = 0  # the bytes of that message so far

    def feed(self, data: bytes) -> list[tuple[int, bytes | str]]:
        chunks = self._chunks
        if chunks:
            self._have += len(data)
            chunks.append(data)
            if self._have < self._need:
                return []
            data = b"".join(chunks)
            chunks.clear()
        out: list[tuple[int, bytes | str]] = []
        pos, n = 0, len(data)
        need = 0  # what the frame at ``pos`` needs in all, once its head is known
        while n - pos >= 2:
            b0, b1 = data[pos], data[pos + 1]
            length, head = b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                (length,) = _LEN16.unpack_from(data, pos + 2)
                head = 4
                if length < 126:
                    raise Failure(PROTOCOL_ERROR, "a length not in its shortest form")
            elif length == 127:
                if n - pos < 10:
                    break
                (length,) = _LEN64.unpack_from(data, pos + 2)
                head = 10
                if length >> 63:
                    raise Failure(PROTOCOL_ERROR, "a 64-bit length with its top bit set")
                if length < 1 << 16:
                    raise Failure(PROTOCOL_ERROR, "a length not in its shortest form")
            self._check(b0, b1, length)
            end = pos + head + 4 + length
            if end > n:
                need = end - pos
                break
            mask = data[pos + head : pos + head + 4]
            payload = apply_mask(data[pos + head + 4 : end], mask) if length else b""
            pos = end
            message = self._frame(b0, payload)
            if message is not None:
                out.append(message)
        if pos < n:  # a frame not complete yet: kept until ``need`` bytes are here
            rest = data[pos:]
            self._chunks.append(rest)
            self._have, self._need = len(rest), need
        else:
            self._have = self._need = 0
        return out

    def _check(self, b0: int, b1: int, length: int) -> None:
        """A frame's head, before its payload is read."""
        opcode = b0 & 0x0F
        if not b1 & 0x80:
            raise Failure(PROTOCOL_ERROR, "a client frame must be masked")
        if b0 & 0x30 or (b0 & 0x40 and (self._deflate is None or opcode not in (TEXT, BINARY))):
            raise Failure(PROTOCOL_ERROR, "a reserved bit is set")
        if opcode & 0x8:
            if opcode not in (CLOSE, PING, PONG):
                raise Failure(PROTOCOL_ERROR, f"unknown opcode {opcode}")
            if not b0 & 0x80 or length > 125:
                raise Failure(PROTOCOL_ERROR, "a control frame must be whole and <= 125 bytes")
        elif opcode not in (CONTINUATION, TEXT, BINARY):
            raise Failure(PROTOCOL_ERROR, f"unknown opcode {opcode}")
        elif length + (self._size if opcode == CONTINUATION else 0) > self._max:
            raise Failure(TOO_BIG, f"a message is larger than {self._max} bytes")

    def _frame(self, b0: int, payload: bytes) -> tuple[int, bytes | str] | None:
        opcode, fin = b0 & 0x0F, bool(b0 & 0x80)
        if opcode == CLOSE:
            _check_close(payload)
        if opcode & 0x8:
            return opcode, payload
        if self._deflate is not None and (b0 & 0x40 or (opcode == CONTINUATION and self._opcode)):
            payload = self._inflate(opcode, fin, bool(b0 & 0x40), payload)
        if opcode == CONTINUATION:
            if not self._opcode:
                raise Failure(PROTOCOL_ERROR, "a continuation frame with no message to continue")
            self._parts.append(payload)
            self._size += len(payload)
            if not fin:
                return None
            opcode, payload = self._opcode, b"".join(self._parts)
            self._opcode, self._parts, self._size = 0, [], 0
        elif self._opcode:
            raise Failure(PROTOCOL_ERROR, "a new message before the last one's final frame")
        elif not fin:
            self._opcode, self._parts, self._size = opcode, [payload], len(payload)
            return None
        if opcode == TEXT:
            try:
                return TEXT, payload.decode()
            except UnicodeDecodeError:
                raise Failure(INVALID_DATA, "a text message is not UTF-8") from None
        return BINARY, payload

    def _inflate(self, opcode: int, fin: bool, rsv1: bool, payload: bytes) -> bytes:
        assert self._deflate is not None
        frame = Frame(Opcode(opcode), payload, fin=fin, rsv1=rsv1)
        left = self._max - (self._size if opcode == CONTINUATION else 0)
        try:
            return bytes(self._deflate.decode(frame, max_size=left).data)
        except PayloadTooBig:
            raise Failure(TOO_BIG, f"a message is larger than {self._max} bytes") from None
        except ProtocolError as e:
            if isinstance(e.__cause__, zlib.error):  # frames well formed, their data not deflate
                raise Failure(INVALID_DATA, "a compressed message that does not inflate") from None
            raise Failure(PROTOCOL_ERROR, str(e)) from None


def _check_close(payload: bytes) -> None:
    """A close frame's code and reason (RFC 6455 7.4): 1002 or 1007 when they are bad."""
    try:
        Close.parse(payload)
    except ProtocolError as e:
        raise Failure(PROTOCOL_ERROR, f"a bad close frame: {e}") from None
    except UnicodeDecodeError:
        raise Failure(INVALID_DATA, "a close reason that is not UTF-8") from None


def frame(opcode: int, payload: bytes) -> bytes:
    """A frame as the server sends it: final, unmasked, uncompressed."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 1 << 16:
        return bytes((0x80 | opcode, 126)) + _LEN16.pack(n) + payload
    return bytes((0x80 | opcode, 127)) + _LEN64.pack(n) + payload


def close_body(code: int, reason: str) -> bytes:
    """A close frame's payload: the code and the reason, cut to fit a control frame."""
    return Close(code, reason.encode()[:120].decode(errors="ignore")).serialize()


# -- the connection -------------------------------------------------------------------------
class Listener:
    """What a ``WebSocket`` tells its owner (the server's per-connection state)."""

    __slots__ = ()

    def message(self, data: bytes | str) -> None: ...
    def seen(self) -> None: ...
    def failed(self, failure: Failure) -> None: ...
    def ended(self) -> None: ...


class WebSocket(asyncio.Protocol):
    """One connection after its handshake, with the methods the server calls on aiohttp's
    ``WebSocketResponse`` (``send_bytes``, ``send_str``, ``ping``, ``close``, ``closed``)."""

    __slots__ = (
        "_closed_wait",
        "_drain",
        "_frames",
        "_linger",
        "_listener",
        "_transport",
        "close_code",
    )

    def __init__(self, frames: Frames, listener: Listener) -> None:
        self._frames = frames
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._drain: asyncio.Future[None] | None = None  # set while writing is paused
        self._closed_wait: asyncio.Future[None] | None = None  # a close waiting for the end
        self._linger: asyncio.TimerHandle | None = None  # while a failed connection is drained
        self.close_code: int | None = None  # the close code sent, once sent

    @property
    def closed(self) -> bool:
        return self.close_code is not None or self._transport is None

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # failed: what the client still sends is read and dropped
        try:
            received = self._frames.feed(data)
        except Failure as failure:
            self._listener.failed(failure)
            self._fail(failure)
            return
        if not received:
            return
        self._listener.seen()
        for opcode, payload in received:
            if opcode in (BINARY, TEXT):
                if self.close_code is None:  # (after a close: nothing new is taken)
                    self._listener.message(payload)
            elif opcode == PING:
                self._write(frame(PONG, payload))  # type: ignore[arg-type]
            elif opcode == CLOSE:  # answered with its code (1000 when it has none); the end
                self._end(int.from_bytes(payload[:2], "big") or 1000, payload[:2])  # type: ignore[arg-type,index]
                return

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._linger is not None:
            self._linger.cancel()
        for waiter in (self._drain, self._closed_wait):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._listener.ended()

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- reading pace ---------------------------------------------------------------------
    def pause_reading(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    # -- sending ------------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    async def _send(self, opcode: int, payload: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the WebSocket connection is closed")
        self._transport.write(frame(opcode, payload))
        if self._drain is not None:
            await self._drain

    async def send_bytes(self, data: bytes) -> None:
        await self._send(BINARY, data)

    async def send_str(self, data: str) -> None:
        await self._send(TEXT, data.encode())

    async def ping(self, data: bytes = b"") -> None:
        self._write(frame(PING, data))

    async def close(self, *, code: int = 1000, message: bytes = b"") -> None:
        """Send a close frame and wait (up to ``CLOSE_TIMEOUT_S``) for the client's, then end
        the connection."""
        if self._transport is None:
            return
        if self.close_code is None:
            self.close_code = code
            self._write(frame(CLOSE, close_body(code, message.decode(errors="replace"))))
        waiter = self._closed_wait
        if waiter is None:
            waiter = self._closed_wait = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), CLOSE_TIMEOUT_S)
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()

    def _fail(self, failure: Failure) -> None:
        """Send the close frame with the failure's code, then end the connection so that the
        client reads that frame: the sending side is shut at once (the client reads the close
        frame, then the end of the stream) and what the client still sends (the rest of a message
        over the limit, say) is read and dropped until it closes its side, or for
        ``CLOSE_TIMEOUT_S``. Closing with bytes unread would reset the connection instead, and a
        reset discards the close frame before the client reads it."""
        transport = self._transport
        if transport is None or not transport.can_write_eof():
            self._end(failure.code, close_body(failure.code, failure.reason))
            return
        if self.close_code is None:
            self.close_code = failure.code
            self._write(frame(CLOSE, close_body(failure.code, failure.reason)))
        transport.write_eof()
        transport.resume_reading()
        loop = asyncio.get_running_loop()
        self._linger = loop.call_later(CLOSE_TIMEOUT_S, transport.abort)

    def _end(self, code: int, body: bytes) -> None:
        """Send a close frame (unless one was sent: this one answers it), then end the
        connection once what is buffered is written."""
        if self.close_code is None:
            self.close_code = code
            self._write(frame(CLOSE, body))
        if self._transport is not None:
            self._transport.close()
