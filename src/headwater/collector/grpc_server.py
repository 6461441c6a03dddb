"""The gRPC intake: Raccoon's ``EventService/SendEvent`` on its own port.

The server speaks HTTP/2 itself (``http2``), on the intake's event loop, for the one unary method
it serves. grpc.aio's server was the bound here: with one connection carrying many calls (a gRPC
client's normal shape) about 60% of the intake's loop thread went to grpc.aio's own per-call
machinery (270-350 µs a call, measured). A call here is a few frames parsed from the bytes
received, one task running ``handle``, and three frames written back (joined with the other
answers ready in the same loop turn), with nothing in another thread.

``handle(request bytes, metadata, peer ip)`` gets the request message as the client sent it (so
it goes through the same decoder as the WebSocket and REST intakes: a bad request is answered
with a normal ``SendEventResponse``, ``STATUS_ERROR``/``CODE_BAD_REQUEST`` and a reason, as
Raccoon answers it) and returns the serialized response. A ``Rejected`` it raises is answered
with its code and reason, and any other exception with ``CODE_INTERNAL_ERROR`` (and logged).
Metadata keys are lowercase (HTTP/2 sends them so), binary ``-bin`` entries are left out, and the
first value of a repeated key wins.

What the server answers with a gRPC status instead (the handler never sees these calls):
- a message over ``max_message_bytes``: ``RESOURCE_EXHAUSTED`` naming both sizes, as soon as
  the message's length prefix arrives; the rest of it is not read;
- a request not whole within ``request_timeout_s``: ``DEADLINE_EXCEEDED``, and reset;
- a path other than ``/raccoon.EventService/SendEvent``: ``UNIMPLEMENTED``;
- a ``grpc-encoding`` other than identity, gzip or deflate: ``UNIMPLEMENTED``;
- no message, a cut-off one, or more than one: ``INTERNAL``;
- a call still running when ``stop``'s grace ends: ``CANCELLED``.
A content-type other than ``application/grpc...`` gets HTTP 415 and a method other than POST 405,
with a text body. These answers come once the request is whole, so the stream is checked against
RFC 9113's states until then. A frame the protocol forbids is a stream error (RST_STREAM) or a
connection error (GOAWAY naming the problem) as the RFC says; a client that makes the server
reset many streams, or sends many PING, SETTINGS or PRIORITY frames, or a header block in
endless CONTINUATION frames, is ended with ``ENHANCE_YOUR_CALM``. Calls a broken connection already
handed to ``handle`` still run to the end, and only their answers are lost.

A call's ``grpc-timeout`` is not enforced here: the client gives up on its own at its deadline,
while the handler goes on, so an event published after the client stopped waiting is kept (the
request's ``req_guid`` lets a retry be recognised).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import quote

from headwater.collector import http2 as h2
from headwater.collector.errors import Code, Rejected
from headwater.collector.grpc_request import Request, parse_request, shown
from headwater.collector.protocols import raccoon

log = logging.getLogger(__name__)

_INTERNAL = Rejected(
    "the collector failed to handle the request",
    status=500,
    code=Code.INTERNAL_ERROR,
    kind="internal",
)

Handle = Callable[[bytes, Mapping[str, str], str], Awaitable[bytes]]
"""``handle(request bytes, metadata, peer ip) -> serialized SendEventResponse``."""

BACKLOG = 4096
MAX_STREAMS = 1024
"""Calls one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS)."""
RECEIVE_WINDOW = 1 << 24
"""How much a client may send ahead of the server's reading, per stream and per connection."""
MAX_FRAME = h2.MIN_FRAME_SIZE
"""The largest frame a client may send (the protocol's default, so not advertised): a header
block larger than one frame comes in CONTINUATION frames, and a message in many DATA frames."""
MAX_HEADER_LIST = 16_384
"""Metadata larger than this (as HPACK counts it) is refused with RESOURCE_EXHAUSTED."""
DECODE_LIMIT = 65_536
"""A header block that would decode to more than this breaks the connection (its table)."""
MAX_CONTINUATIONS = 64
"""CONTINUATION frames one header block may take; more end the connection (CVE-2024-27316)."""
CLOSED_REMEMBERED = 2 * MAX_STREAMS
"""Closed streams a connection remembers, to tell a frame on a closed stream (an error) from one
on a stream it reset (dropped: the client may have sent it before it saw the reset)."""
RESET_BURST, RESET_RATE = 1000, 33.0
"""Streams a connection may have reset, by the client or by the server for its errors, at once
and then per second, before it is ended with ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487,
and its variant where the client makes the server reset, CVE-2025-8671)."""
CONTROL_BURST, CONTROL_RATE = 1000, 100.0
"""PING, SETTINGS and PRIORITY frames a connection may send at once and then per second, and
each call it opens adds one (flood protection: each of these costs the server work, gives none)."""
LINGER_S = 2.0
"""How long a connection ended for an error is still read (and what it sends dropped), so that
the client reads the GOAWAY before the connection closes."""
CALLS_PER_TURN = 32
"""Calls one connection may start in one turn of the event loop: the rest of what it sent waits
for the next turn, so the other connections' frames are read in between (a client sending
thousands of calls at once, or a rapid reset, delays the others by a slice, not by all of it)."""
MAX_HANDLING = 64
"""Calls of one connection in the handler at once: past it, the connection's further frames wait
unread until one is answered, so no client queues more work ahead of the other clients' calls
(a rapid reset's calls, each reset as soon as sent, still run: the event may be kept)."""
IDLE_TIMEOUT_S = 300.0
"""A connection with no call in a handler that sends nothing for this long is closed (GOAWAY)."""

OK, CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 1, 4, 8, 12, 13
_SELF_DEPENDENT = 0x100  # beside a HEADERS frame's flags (a byte): its priority names itself
_ENCODINGS = {b"identity": 0, b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
_ACCEPT = h2.literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
_CONTENT_TYPE = h2.literal(b"content-type", b"application/grpc")
_TEXT = h2.literal(b"content-type", b"text/plain; charset=utf-8")
_RESPONSE_HEADERS = h2.STATUS_200 + _CONTENT_TYPE + _ACCEPT
_OK_TRAILERS = h2.literal(b"grpc-status", b"0")
_SETTINGS = h2.settings_frame(
    {
        h2.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
        h2.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
        h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        h2.ENABLE_PUSH: 0,
    }
)
_GREETING = _SETTINGS + h2.window_update(0, RECEIVE_WINDOW - h2.DEFAULT_WINDOW)


def length_prefixed(message: bytes) -> bytes:
    """A gRPC message as it travels in DATA frames: uncompressed (flag 0), its length, itself."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def _status_block(
    code: int, message: str, http_status: int = 200, content_type: bytes = _CONTENT_TYPE
) -> bytes:
    """A trailers-only answer's header block: gRPC status ``code`` with ``message``."""
    encoded = quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()
    return (
        h2.status(http_status)
        + content_type
        + h2.literal(b"grpc-status", str(code).encode())
        + h2.literal(b"grpc-message", encoded)
    )


class _Stream:
    __slots__ = (
        "chunks",
        "ended",
        "held",
        "id",
        "opened",
        "pending",
        "problem",
        "received",
        "request",
        "tail",
        "unread",
        "window",
    )

    def __init__(self, stream_id: int, request: Request, window: int, opened: float) -> None:
        self.id = stream_id
        self.request = request
        self.opened = opened  # the server's clock when its HEADERS came
        self.chunks: list[bytes] = []
        self.received = 0  # DATA bytes so far (without padding)
        self.held = 0  # bytes of the connection's receive window this request holds
        self.unread = 0  # flow-controlled bytes not yet given back with a WINDOW_UPDATE
        self.window = window  # what the client lets this stream send it
        self.pending = b""  # an answer's DATA waiting for the client's windows
        self.tail: bytes | None = None  # what follows it: trailers, or None (END_STREAM on DATA)
        self.ended = False  # the client has sent all of its request (END_STREAM)
        self.problem: tuple[int, str, int] | None = None  # the answer, once the request is whole


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/2 frames in, calls to ``handle``, answers out.

    Streams follow RFC 9113 §5.1: ``_streams`` holds the open and half-closed ones; a stream id
    above ``_last_id`` is idle; ``_closed`` remembers the last ``CLOSED_REMEMBERED`` streams
    closed, and by whom. A frame the state does not allow is a stream or connection error as the
    RFC says, except on a stream this side reset (the client may have sent it before it saw the
    reset: dropped) or one closed too long ago to be remembered (dropped too).
    """

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.last_seen = server.clock  # when the client last sent anything
        self._buffer = bytearray()
        self._preface = False
        self._blocks = h2.HeaderBlocks(parse_request, DECODE_LIMIT)
        self._continuing: tuple[int, int, list[bytes]] | None = None
        self._streams: dict[int, _Stream] = {}
        self._closed: OrderedDict[int, bool] = OrderedDict()  # True: closed by the client
        self._last_id = 0
        self._unread = 0  # connection-level bytes not yet given back
        self._window = h2.DEFAULT_WINDOW  # what the client lets the connection send it
        self._stream_window = h2.DEFAULT_WINDOW  # its SETTINGS_INITIAL_WINDOW_SIZE
        self._frame_limit = h2.MIN_FRAME_SIZE  # its SETTINGS_MAX_FRAME_SIZE
        self._resets = h2.Budget(RESET_BURST, RESET_RATE)
        self._control = h2.Budget(CONTROL_BURST, CONTROL_RATE)
        self._blocked: list[_Stream] = []
        self._out: list[bytes] = []
        self._flushing = False
        self._going_away = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn_calls = 0  # calls started in this turn of the loop
        self._handling = 0  # calls in the handler
        self._deferred = False  # frames wait in the buffer: for the next turn, or for a call
        self._turn_due = False  # the next turn is scheduled
        self._write_paused = False

    # -- the transport ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else ""
        self.server.connections.add(self)
        self.transport.write(_GREETING)
        if self.server.stopping:
            self.go_away()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._streams.clear()
        self._blocked.clear()
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        """The client is not reading what it is sent: read nothing more from it until it does
        (its PINGs and calls would otherwise grow the answers waiting here)."""
        self._write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is not None and not self._deferred:
            self.transport.resume_reading()

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flushing:
            self._flushing = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what the loop turn produced; a connection going away closes once its last
        call is answered (every answer ends in a frame sent, so in a flush)."""
        self._flushing = False
        out, self._out = self._out, []
        if self.transport is not None and out:
            self.transport.write(b"".join(out))
            if self._going_away and not self._streams:
                self.transport.close()

    def _fail(self, failure: h2.ConnectionFailure, abort: bool = False) -> None:
        """End the connection with a GOAWAY naming ``failure``; ``abort`` drops what the client
        has not read instead of waiting for it to read it."""
        log.info("gRPC connection from %s closed: %s", self.peer or "?", failure)
        transport = self.transport
        if transport is not None:
            self._out.append(h2.goaway(self._last_id, failure.code, str(failure)))
            out, self._out = self._out, []
            transport.write(b"".join(out))
            if abort:
                transport.abort()
            elif transport.can_write_eof() and self._loop is not None:
                # A close with the client's bytes unread would reset the connection and could
                # lose the GOAWAY: end the sending side, read on (dropping it all) a while.
                transport.write_eof()
                self._loop.call_later(LINGER_S, transport.close)
            else:
                transport.close()
            self.transport = None  # nothing more is written, nothing more is read
        self._streams.clear()
        self._blocked.clear()

    def go_away(self) -> None:
        """Take no new calls (the client opens another connection for them), finish the ones
        already here, then close."""
        if not self._going_away and self.transport is not None:
            self._going_away = True
            self._send(h2.goaway(self._last_id, h2.NO_ERROR))

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()

    def check_deadlines(self, now: float) -> None:
        """Answer requests not whole within the request timeout, and close the connection when
        the client has sent nothing for the idle timeout and no call of it is in a handler."""
        if self.transport is None:
            return
        server = self.server
        late = now - server.request_timeout_s
        for s in [s for s in self._streams.values() if not s.ended and s.opened <= late]:
            message = f"the request was not sent within {server.request_timeout_s:g} s"
            self._answer_early(s, DEADLINE_EXCEEDED, message, 200)
        if now - self.last_seen >= server.idle_timeout_s and not any(
            s.ended and not s.pending for s in self._streams.values()
        ):
            idle = f"nothing received for {server.idle_timeout_s:g} s"
            self._fail(h2.ConnectionFailure(h2.NO_ERROR, idle), abort=True)

    # -- frames in -------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # ended (a deadline) with bytes still coming
            return
        self.last_seen = self.server.clock
        if self._deferred:  # read before the pause took: it waits behind the frames buffered
            self._buffer += data
            return
        self._receive(data)

    def call_done(self) -> None:
        """A call of this connection left the handler: frames waiting for it are handled."""
        self._handling -= 1
        if self._deferred and not self._turn_due:
            self._next_turn_soon()

    def _next_turn_soon(self) -> None:
        self._turn_due = True
        assert self._loop is not None
        self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """Go on with the frames a turn left in the buffer, and read again once they are done."""
        self._turn_due = False
        self._deferred = False
        if self.transport is None:
            return
        self._receive(b"")
        if not self._deferred and not self._write_paused and self.transport is not None:
            self.transport.resume_reading()

    def _receive(self, data: bytes) -> None:
        if self._buffer:  # the start of a frame came before, or a turn's frames were left
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        self._turn_calls = 0
        try:
            end = self._frames(data)
        except h2.ConnectionFailure as failure:
            self._fail(failure)
            return
        except Exception:  # a bug here: this connection ends, the server goes on
            log.exception("gRPC connection from %s failed", self.peer or "?")
            self._fail(h2.ConnectionFailure(h2.INTERNAL_ERROR, "the server failed"))
            return
        if end < len(data):
            self._buffer += memoryview(data)[end:]
            if self.transport is not None and (
                self._turn_calls >= CALLS_PER_TURN or self._handling >= MAX_HANDLING
            ):
                self._deferred = True
                self.transport.pause_reading()
                if self._handling < MAX_HANDLING:  # else the next call answered resumes it
                    self._next_turn_soon()

    def _frames(self, buffer: bytes) -> int:
        """Handle each whole frame in ``buffer``; returns how many bytes they took."""
        pos = 0
        if not self._preface:
            if len(buffer) < len(h2.PREFACE):
                if not h2.PREFACE.startswith(buffer):
                    raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "not an HTTP/2 connection")
                return 0
            if buffer[: len(h2.PREFACE)] != h2.PREFACE:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "not an HTTP/2 connection")
            self._preface = True
            pos = len(h2.PREFACE)
        size = len(buffer)
        unpack = h2.FRAME_HEAD.unpack_from
        while (
            size - pos >= h2.FRAME_HEAD_SIZE
            and self._turn_calls < CALLS_PER_TURN
            and self._handling < MAX_HANDLING
        ):
            high, low, kind, flags, stream = unpack(buffer, pos)
            length = high << 8 | low
            if length > MAX_FRAME:
                raise h2.ConnectionFailure(
                    h2.FRAME_SIZE_ERROR,
                    f"a {length}-byte frame, over SETTINGS_MAX_FRAME_SIZE {MAX_FRAME} (§4.2)",
                )
            start = pos + h2.FRAME_HEAD_SIZE
            if size - start < length:
                break
            pos = start + length
            payload = buffer[start:pos]
            stream &= h2.MAX_WINDOW
            if self._continuing is not None and kind != h2.CONTINUATION:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a header block was interrupted")
            if kind == h2.DATA:
                self._data(stream, flags, payload)
            elif kind == h2.HEADERS:
                self._headers(stream, flags, payload)
            elif kind == h2.CONTINUATION:
                self._continuation(stream, flags, payload)
            elif kind == h2.WINDOW_UPDATE:
                self._window_update(stream, payload)
            elif kind == h2.SETTINGS:
                self._settings(stream, flags, payload)
            elif kind == h2.PING:
                if stream or length != 8:
                    raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a malformed PING")
                if not flags & h2.ACK:
                    self._spend_control("PING")
                    self._send(h2.frame(h2.PING, h2.ACK, 0, payload))
            elif kind == h2.RST_STREAM:
                if not stream or length != 4:
                    raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a malformed RST_STREAM")
                self._reset(stream)
            elif kind == h2.PUSH_PROMISE:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a client cannot push")
            elif kind == h2.GOAWAY and stream:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a GOAWAY on a stream")
            elif kind == h2.PRIORITY:
                self._priority(stream, payload)
            # GOAWAY (the client closes when it is done) and unknown types: nothing
        return pos

    def _spend_control(self, kind: str) -> None:
        if not self._control.spend(self.server.clock):
            raise h2.ConnectionFailure(
                h2.ENHANCE_YOUR_CALM,
                f"more than {CONTROL_BURST} PING, SETTINGS and PRIORITY frames and "
                f"{CONTROL_RATE:g} a second (a flood of {kind})",
            )

    def _spend_reset(self) -> None:
        if not self._resets.spend(self.server.clock):
            raise h2.ConnectionFailure(
                h2.ENHANCE_YOUR_CALM,
                f"more than {RESET_BURST} streams reset and {RESET_RATE:g} a second "
                "(rapid reset, CVE-2023-44487)",
            )

    def _priority(self, stream: int, payload: bytes) -> None:
        """Priorities are not acted on, but a malformed PRIORITY frame is an error."""
        if not stream:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "PRIORITY on stream 0 (RFC 9113 §6.3)")
        self._spend_control("PRIORITY")
        if len(payload) != 5:
            self._stream_error(stream, h2.FRAME_SIZE_ERROR)
        elif h2.u32(payload[:4]) == stream:
            self._stream_error(stream, h2.PROTOCOL_ERROR)  # depends on itself (§5.3.1)

    def _settings(self, stream: int, flags: int, payload: bytes) -> None:
        if stream:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise h2.ConnectionFailure(
                    h2.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload (§6.5)"
                )
            return
        self._spend_control("SETTINGS")
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.ConnectionFailure(h2.FLOW_CONTROL_ERROR, "a window over 2^31-1")
                change, self._stream_window = value - self._stream_window, value
                for s in self._streams.values():
                    s.window += change
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.MIN_FRAME_SIZE <= value <= h2.MAX_FRAME_SIZE_LIMIT:
                    raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, f"a frame size of {value}")
                self._frame_limit = value
            elif key == h2.ENABLE_PUSH and value > 1:
                raise h2.ConnectionFailure(
                    h2.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH of {value} (RFC 9113 §6.5.2)"
                )
        self._send(h2.frame(h2.SETTINGS, h2.ACK, 0))
        self._unblock()

    def _window_update(self, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise h2.ConnectionFailure(h2.FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE")
        increment = h2.u32(payload)
        if not stream:
            if not increment:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._window += increment
            if self._window > h2.MAX_WINDOW:
                raise h2.ConnectionFailure(h2.FLOW_CONTROL_ERROR, "a window over 2^31-1")
        else:
            s = self._streams.get(stream)
            if s is None:
                if stream > self._last_id:
                    raise h2.ConnectionFailure(
                        h2.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream} (§5.1)"
                    )
                if not increment:  # on a stream already closed here
                    self._stream_error(stream, h2.PROTOCOL_ERROR)
                return  # closed: one in flight when it closed is allowed (§5.1)
            if not increment:
                self._stream_error(stream, h2.PROTOCOL_ERROR)  # §6.9
                return
            if s.window + increment > h2.MAX_WINDOW:
                self._stream_error(stream, h2.FLOW_CONTROL_ERROR)  # §6.9.1
                return
            s.window += increment
        self._unblock()

    def _headers(self, stream: int, flags: int, payload: bytes) -> None:
        if not stream or not stream & 1:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, f"HEADERS on stream {stream}")
        payload = h2.strip_padding(flags, payload)
        if flags & h2.PRIORITY_FLAG:
            if len(payload) < 5:
                raise h2.ConnectionFailure(h2.FRAME_SIZE_ERROR, "HEADERS too short for priority")
            if h2.u32(payload[:4]) == stream:  # depends on itself (§5.3.1): its block still counts
                flags |= _SELF_DEPENDENT
            payload = payload[5:]
        if flags & h2.END_HEADERS:
            self._block(stream, flags, payload)
        else:
            self._continuing = (stream, flags, [payload])

    def _continuation(self, stream: int, flags: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != stream:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "a CONTINUATION out of place")
        _, first_flags, parts = self._continuing
        parts.append(payload)
        if sum(map(len, parts)) > DECODE_LIMIT:
            raise h2.ConnectionFailure(h2.COMPRESSION_ERROR, "a header block over 64 KiB")
        if len(parts) > MAX_CONTINUATIONS:
            raise h2.ConnectionFailure(
                h2.ENHANCE_YOUR_CALM,
                f"a header block in over {MAX_CONTINUATIONS} CONTINUATION frames (CVE-2024-27316)",
            )
        if flags & h2.END_HEADERS:
            self._continuing = None
            self._block(stream, first_flags, b"".join(parts))

    def _block(self, stream: int, flags: int, block: bytes) -> None:
        """A whole header block: a new call, or a request's trailers."""
        request = self._blocks.decode(block)  # every block, in order: the table depends on it
        known = self._streams.get(stream)
        if known is not None:  # trailers end the request
            problem = request.trailers_problem
            if known.ended:  # half-closed (remote): only WINDOW_UPDATE, PRIORITY, RST (§5.1)
                self._stream_error(stream, h2.STREAM_CLOSED)
            elif problem or not flags & h2.END_STREAM or flags & _SELF_DEPENDENT:
                log.debug("gRPC stream %d refused: %s", stream, problem or "not trailers")
                self._stream_error(stream, h2.PROTOCOL_ERROR)
            else:
                self._ended(known)
            return
        if stream <= self._last_id:
            closed_by_client = self._closed.get(stream)
            if closed_by_client is None:
                raise h2.ConnectionFailure(
                    h2.PROTOCOL_ERROR,
                    f"HEADERS opening stream {stream} after stream {self._last_id} (§5.1.1)",
                )
            if closed_by_client:
                raise h2.ConnectionFailure(
                    h2.STREAM_CLOSED, f"HEADERS on stream {stream}, closed (§5.1)"
                )
            return  # reset here: sent before the client saw the reset
        self._last_id = stream
        self._control.earn()  # a call opened: one control frame more is fair
        problem = request.request_problem
        if problem or flags & _SELF_DEPENDENT:
            log.debug("gRPC stream %d refused: %s", stream, problem or "depends on itself")
            self._stream_error(stream, h2.PROTOCOL_ERROR)
            return
        if self._going_away or len(self._streams) >= MAX_STREAMS:
            self._send(h2.rst_stream(stream, h2.REFUSED_STREAM))
            self._close(stream, False)
            return
        s = _Stream(stream, request, self._stream_window, self.server.clock)
        self._streams[stream] = s
        s.problem = self._check(request)
        if flags & h2.END_STREAM:
            self._ended(s)

    @staticmethod
    def _check(request: Request) -> tuple[int, str, int] | None:
        """Why a call is answered without reaching the handler: the gRPC status, its message
        and the HTTP status (not 200: the request is not a gRPC call at all)."""
        if not request.content_type.startswith(b"application/grpc"):
            return UNIMPLEMENTED, "the content-type must be application/grpc", 415
        if request.method != b"POST":
            return UNIMPLEMENTED, f"gRPC calls are POSTs, not {shown(request.method)}", 405
        if request.path != raccoon.METHOD.encode():
            return UNIMPLEMENTED, f"no method {shown(request.path)}", 200
        if request.encoding not in _ENCODINGS:
            return UNIMPLEMENTED, f"the compression {shown(request.encoding)} is unknown", 200
        if request.size > MAX_HEADER_LIST:
            return (
                RESOURCE_EXHAUSTED,
                f"the metadata is {request.size} bytes, over the limit of {MAX_HEADER_LIST}",
                200,
            )
        return None

    def _data(self, stream: int, flags: int, payload: bytes) -> None:
        if not stream:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, "DATA on stream 0")
        flowed = len(payload)
        message = h2.strip_padding(flags, payload)  # bad padding breaks the connection (§6.1)
        s = self._streams.get(stream)
        if s is None or s.ended:
            self._credit(flowed)  # never read: the connection's window is given back at once
            if s is not None:  # half-closed (remote): the request was whole (§5.1)
                self._stream_error(stream, h2.STREAM_CLOSED)
            elif stream > self._last_id:
                raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, f"DATA on idle stream {stream}")
            elif self._closed.get(stream):
                raise h2.ConnectionFailure(
                    h2.STREAM_CLOSED, f"DATA on stream {stream}, closed (§5.1)"
                )
            return  # a stream reset here (or long closed): its data is dropped
        first = not s.received
        s.received += len(message)
        expected = s.request.content_length
        if 0 <= expected < s.received:
            self._credit(flowed)
            self._stream_error(stream, h2.PROTOCOL_ERROR)  # more than content-length (§8.1.1)
            return
        if s.problem is not None:  # answered once whole: its data is not kept
            self._credit(flowed)
        else:
            s.held += flowed  # given back to the connection's window once the request is whole
            if first and len(message) >= 5:  # the length prefix, checked at once
                size = int.from_bytes(message[1:5], "big")
                limit = self.server.max_message_bytes
                if size > limit:
                    self._answer_early(
                        s,
                        RESOURCE_EXHAUSTED,
                        f"the request message is {size} bytes, over the limit of {limit}",
                        200,
                    )
                    return
            s.chunks.append(message)
        if flags & h2.END_STREAM:
            self._ended(s)
            return
        s.unread += flowed
        if s.unread >= RECEIVE_WINDOW // 2:
            self._send(h2.window_update(stream, s.unread))
            s.unread = 0
        if s.problem is None and s.received > self.server.max_message_bytes + 5:
            self._answer_early(s, INTERNAL, "a unary call takes one message", 200)

    def _credit(self, size: int) -> None:
        """Give ``size`` bytes back to the connection's receive window.

        A request's bytes are given back once it is whole (or dropped), not as they arrive, so
        requests still arriving hold at most ``RECEIVE_WINDOW`` of memory per connection."""
        self._unread += size
        if self._unread >= RECEIVE_WINDOW // 2:
            self._send(h2.window_update(0, self._unread))
            self._unread = 0

    def _release(self, s: _Stream) -> None:
        """``s`` is whole or dropped: the window its bytes held goes back to the client."""
        self._credit(s.held)
        s.held = 0

    def _ended(self, s: _Stream) -> None:
        """The client has sent all of ``s``'s request: check it, then answer or call."""
        s.ended = True
        self._release(s)
        expected = s.request.content_length
        if expected >= 0 and s.received != expected:
            self._stream_error(s.id, h2.PROTOCOL_ERROR)  # less than content-length (§8.1.1)
        elif s.problem is None:
            self._request_done(s)
        elif s.problem[2] == 200:
            self.answer(s, status=s.problem[:2])
        else:
            self._answer_http(s, *s.problem)

    def _request_done(self, s: _Stream) -> None:
        body = b"".join(s.chunks)
        s.chunks = []
        if len(body) < 5:
            self.answer(s, status=(INTERNAL, "the call has no whole request message"))
            return
        size = int.from_bytes(body[1:5], "big")
        if len(body) != 5 + size:
            problem = "cut off" if len(body) < 5 + size else "followed by another message"
            self.answer(s, status=(INTERNAL, f"the request message is {problem}"))
            return
        message = body[5:]
        if body[0]:
            wbits = _ENCODINGS[s.request.encoding]
            if not wbits:
                self.answer(s, status=(INTERNAL, "a compressed message without grpc-encoding"))
                return
            limit = self.server.max_message_bytes
            inflate = zlib.decompressobj(wbits)
            try:
                message = inflate.decompress(message, limit + 1)
            except zlib.error as e:
                self.answer(s, status=(INTERNAL, f"the message cannot be decompressed: {e}"))
                return
            if len(message) > limit:
                self.answer(
                    s,
                    status=(
                        RESOURCE_EXHAUSTED,
                        f"the request message is over the limit of {limit} bytes decompressed",
                    ),
                )
                return
            if not inflate.eof:
                self.answer(s, status=(INTERNAL, "the compressed message is cut off"))
                return
        self._turn_calls += 1
        self._handling += 1
        self.server.start_call(self, s, message)

    # -- answers out -----------------------------------------------------------------------------

    def _answer_early(self, s: _Stream, code: int, message: str, http_status: int) -> None:
        """Answer a call before its request is all here, and tell the client to stop sending
        (RFC 9113 §8.1: RST_STREAM with NO_ERROR after a complete response)."""
        self._release(s)
        s.chunks = []
        self.answer(s, status=(code, message), http_status=http_status)
        self._send(h2.rst_stream(s.id, h2.NO_ERROR))

    def _answer_http(self, s: _Stream, code: int, message: str, http_status: int) -> None:
        """Answer a request that is not a gRPC call: ``http_status`` with ``message`` as text
        (and as the gRPC status ``code``, for a gRPC client that took a wrong turn)."""
        if self._streams.get(s.id) is not s or self.transport is None:
            return
        body = message.encode() + b"\n"
        head = _status_block(code, message, http_status, _TEXT)
        head += h2.literal(b"content-length", str(len(body)).encode())
        self._send(h2.frame(h2.HEADERS, h2.END_HEADERS, s.id, head))
        self._send_data(s, body, None)

    def answer(
        self,
        s: _Stream,
        response: bytes | None = None,
        status: tuple[int, str] | None = None,
        http_status: int = 200,
    ) -> None:
        """Send a call's answer: ``response`` with status 0, or trailers only with ``status``."""
        if self._streams.get(s.id) is not s or self.transport is None:
            return  # reset by the client, or the connection is gone
        if status is not None:
            block = _status_block(*status, http_status=http_status)
            self._send(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, s.id, block))
            self._close(s.id, s.ended)
            return
        assert response is not None
        data = length_prefixed(response)
        size = len(data)
        head = h2.frame(h2.HEADERS, h2.END_HEADERS, s.id, _RESPONSE_HEADERS)
        if size <= self._window and size <= s.window and size <= self._frame_limit:
            self._window -= size
            self._send(
                head
                + h2.frame(h2.DATA, 0, s.id, data)
                + h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, s.id, _OK_TRAILERS)
            )
            self._close(s.id, s.ended)
        else:
            self._send(head)
            self._send_data(s, data, _OK_TRAILERS)

    def _send_data(self, s: _Stream, data: bytes, tail: bytes | None) -> None:
        """Send ``data`` on ``s`` as the client's windows let it, then ``tail`` (trailers; None:
        the last DATA ends the stream). ``s`` stays open until it is all out."""
        s.pending, s.tail = data, tail
        self._blocked.append(s)
        self._unblock()

    def _unblock(self) -> None:
        """Send what the client's windows now let through of answers waiting for them."""
        while self._blocked and self._window > 0:
            s = self._blocked[0]
            if self._streams.get(s.id) is not s:
                self._blocked.pop(0)
                continue
            room = min(self._window, s.window, self._frame_limit)
            if room <= 0:
                return
            part, s.pending = s.pending[:room], s.pending[room:]
            self._window -= len(part)
            s.window -= len(part)
            last = not s.pending and s.tail is None
            self._send(h2.frame(h2.DATA, h2.END_STREAM if last else 0, s.id, part))
            if s.pending:
                continue
            self._blocked.pop(0)
            if s.tail is not None:
                self._send(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, s.id, s.tail))
            self._close(s.id, s.ended)

    def _close(self, stream: int, by_client: bool) -> None:
        """``stream`` is closed: answered in full (by the client too if its request was whole),
        or reset by either side."""
        self._streams.pop(stream, None)
        closed = self._closed
        closed[stream] = by_client
        if len(closed) > CLOSED_REMEMBERED:
            closed.popitem(last=False)
        if self._going_away and not self._streams:
            self._send(b"")  # nothing more to send: the flush closes the connection

    def _reset(self, stream: int) -> None:
        """The client cancelled a call: nothing more is sent on it."""
        s = self._streams.get(stream)
        if s is not None:
            self._spend_reset()
            self._release(s)
            self._close(stream, True)
        elif stream > self._last_id:
            raise h2.ConnectionFailure(h2.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream}")

    def _stream_error(self, stream: int, code: int) -> None:
        """End ``stream`` with RST_STREAM ``code`` (RFC 9113 §5.4.2), whether or not it is open
        here; the frames the client had sent on it before it sees the reset are dropped."""
        self._spend_reset()
        s = self._streams.get(stream)
        if s is not None:
            self._release(s)
        self._close(stream, False)
        self._send(h2.rst_stream(stream, code))


class GrpcServer:
    """Serves ``EventService/SendEvent`` with ``handle``; ``start`` binds, ``stop`` drains."""

    def __init__(
        self,
        handle: Handle,
        host: str,
        port: int,
        max_message_bytes: int,
        *,
        share_port: bool = False,
        tls: ssl.SSLContext | None = None,
        request_timeout_s: float = 30.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        tick_s: float = 1.0,
    ) -> None:
        self.handle = handle
        self.request_timeout_s = request_timeout_s  # a request not whole by then is answered
        self.idle_timeout_s = idle_timeout_s
        self.tick_s = tick_s  # how often deadlines are checked: the clock's resolution
        self.clock = 0.0  # the loop's time, as of the last tick (cheap to read per frame)
        self._ticker: asyncio.Task[None] | None = None
        self.tls = tls  # TLS on the port (the context offers ALPN h2), or plain h2c
        self.share_port = share_port  # intake workers share one port (SO_REUSEPORT)
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._calls: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Server | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (``port`` 0 picks a free one)."""
        if self._listener is not None:
            raise RuntimeError("the gRPC server is already started")
        self.stopping = False
        loop = asyncio.get_running_loop()
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            self._listener = await loop.create_server(
                lambda: _Connection(self),
                self.host,
                self.port,
                backlog=BACKLOG,
                # a port another process holds is an error, not a silent share (intake
                # workers share the port their parent reserved)
                reuse_port=self.share_port or None,
                ssl=self.tls,
            )
        except OSError as e:
            raise OSError(e.errno, f"the gRPC server cannot listen on {address}: {e}") from e
        self.port = self._listener.sockets[0].getsockname()[1]
        self.clock = loop.time()
        self._ticker = loop.create_task(self._tick(), name="grpc-deadlines")
        log.info("gRPC server listening on %s:%d", self.host, self.port)
        return self.port

    async def _tick(self) -> None:
        """Move the clock on and check every connection's deadlines, each ``tick_s``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            self.clock = now = loop.time()
            for connection in list(self.connections):
                connection.check_deadlines(now)

    def start_call(self, connection: _Connection, s: _Stream, message: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._call(connection, s, message))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, connection: _Connection, s: _Stream, message: bytes) -> None:
        try:
            response = await self.handle(message, s.request.metadata, connection.peer)
        except Rejected as e:
            response = raccoon.error_response_bytes(e)
        except asyncio.CancelledError:
            connection.answer(s, None, (CANCELLED, "the collector is stopping"))
            raise
        except Exception:
            log.exception("SendEvent from %s failed", connection.peer or "?")
            response = raccoon.error_response_bytes(_INTERNAL)
        finally:
            connection.call_done()
        connection.answer(s, response, None)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let calls in flight finish for up to ``grace`` seconds, then
        cancel what is left."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self.stopping = True
        listener.close()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for connection in list(self.connections):
            connection.go_away()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        left = set(self._calls)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)
        for connection in list(self.connections):
            connection.close()
