"""Measure the candidate server stacks for the collector, so that the choice can be re-measured.

Run from the repository root::

    .venv/bin/python bench/stack_choice.py                  # the full run, about 45 minutes
    .venv/bin/python bench/stack_choice.py --quick          # a smoke run, about 7 minutes
    .venv/bin/python bench/stack_choice.py --stacks aiohttp,floor --rounds 1 --format json

Every stack serves the same collector-shaped handler, written here once per interface:

* WebSocket at ``GET /api/v1/events``: each binary frame is a batch (an opaque payload of 100
  events of 200 bytes); the handler takes its length and a checksum of its head (a small constant
  CPU cost, no protobuf) and answers on the same connection with a 60-byte binary ack;
* ``POST /api/v1/events``: the same work on the body, the ack as the response body.

The stacks (each one process, one event loop thread; ``--stacks`` picks some):

* ``uvicorn-sansio``, ``uvicorn-legacy``, ``uvicorn-wsproto``: uvicorn on uvloop with httptools
  and a bare ASGI app, WebSockets through uvicorn's ``websockets-sansio`` (its default),
  ``websockets`` (legacy, deprecated) and ``wsproto`` implementations;
* ``aiohttp``: aiohttp's own web server and WebSocket on uvloop;
* ``granian-asgi``, ``granian-rsgi``: granian (Rust HTTP and WebSocket, one worker, one runtime
  thread, uvloop) with the ASGI app and with an RSGI app;
* ``websockets``: the websockets library's asyncio server on uvloop (WebSocket only, no REST);
* ``floor``: not a candidate but the reference floor: a bare ``asyncio.Protocol`` on uvloop with
  hand-written HTTP/1.1 and WebSocket framing, to show what each stack costs on top of the loop.

What it measures, loopback only, on this machine (the load generators share its cores):

a) WebSocket throughput: 1, 50 and 1000 connections (``--quick``: 1, 50, 200), each keeping
   4 frames of 20 kB in flight as fast as the server acks ("closed" loop, saturation), then the
   largest count paced at the issue's target of 150k events/s and at the 300k stretch (at most
   4 in flight each); 10 s windows after a 2 s warm-up (``--quick``: 3 s after 1 s), repeated in
   3 rounds (``--rounds``) with the stacks in a rotating order, medians reported. Figures:
   frames/s and events/s, ack latency p50/p95/p99, the server's CPU (all its processes and
   threads), CPU microseconds per frame, RSS, and the load generator's own CPU. The load
   generator is a raw WebSocket client on uvloop that writes pre-built, pre-masked frames (one
   masking key per process, which servers cannot tell from a fresh one) to cost little CPU;
b) the server's RSS with 10,000 idle WebSocket connections (``--quick``: 2,000), opened from two
   processes bound to their own 127.0.0.x source addresses, first right after the handshake and
   then, on a fresh server, after each connection has sent one batch (buffers a stack keeps per
   connection after a frame show up there);
c) REST: requests/s of ``POST`` with 20 kB bodies, keep-alive, 50 concurrent connections, driven
   by ``wrk`` (Debian package ``wrk``; skipped with a note when it is absent);
d) graceful shutdown: one connection with frames in flight when the server gets SIGTERM: which
   close code it receives, how many of the in-flight frames were acked, how long the server took;
e) whether a ``grpc.aio`` server and client work in the same uvloop event loop.

Every child process stops by itself (servers SIGTERM themselves after a deadline, load generators
stop after their window), and a watchdog ends the whole run after a hard time limit. This is a
benchmark, not a test: it exits 0 unless it fails. Progress goes to stderr, figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, cast

# -- the workload -------------------------------------------------------------------------------
PATH = "/api/v1/events"
EVENTS_PER_BATCH = 100
EVENT_BYTES = 200
BATCH_BYTES = EVENTS_PER_BATCH * EVENT_BYTES  # 20,000 bytes per frame or body
IN_FLIGHT = 4  # frames a connection may have sent and not yet seen acked
# A stand-in for a SendEventResponse (status, code, sent_time, data{req_guid}): 60 bytes.
ACK = b"\x08\x01\x10\x01\x18\xf0\xb8\xd6\xc4\x06*0\n\x08req_guid\x12$" + b"0" * 36
MAX_FRAME = 1 << 20  # the per-frame (per-message) limit every stack is configured with
PING_INTERVAL_S = 30.0
PING_TIMEOUT_S = 60.0
HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent

STACKS: dict[str, str] = {
    "uvicorn-sansio": "uvicorn + uvloop + httptools, ws=websockets-sansio (uvicorn's default)",
    "uvicorn-legacy": "uvicorn + uvloop + httptools, ws=websockets (legacy, deprecated)",
    "uvicorn-wsproto": "uvicorn + uvloop + httptools, ws=wsproto",
    "aiohttp": "aiohttp web server + its WebSocket, on uvloop",
    "granian-asgi": "granian, ASGI, 1 worker, 1 runtime thread, uvloop",
    "granian-rsgi": "granian, RSGI, 1 worker, 1 runtime thread, uvloop",
    "websockets": "websockets asyncio server on uvloop (WebSocket only)",
    "floor": "reference floor: a bare asyncio.Protocol on uvloop, hand-written framing",
}
NO_REST = {"websockets"}
STACK_MODULES: dict[str, tuple[str, ...]] = {
    "uvicorn-sansio": ("uvicorn", "uvloop", "httptools", "websockets"),
    "uvicorn-legacy": ("uvicorn", "uvloop", "httptools", "websockets"),
    "uvicorn-wsproto": ("uvicorn", "uvloop", "httptools", "wsproto"),
    "aiohttp": ("aiohttp", "uvloop"),
    "granian-asgi": ("granian", "uvloop"),
    "granian-rsgi": ("granian", "uvloop"),
    "websockets": ("websockets", "uvloop"),
    "floor": ("websockets", "uvloop"),  # websockets for its C unmasking function
}


def handle_batch(payload: bytes) -> bytes:
    """The collector's work on one batch, reduced to a small constant: count and checksum."""
    events = len(payload) // EVENT_BYTES
    checksum = zlib.crc32(payload[:256])
    return ACK if events >= 0 and checksum >= 0 else b""


# -- the servers --------------------------------------------------------------------------------
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def asgi_app(scope: Message, receive: Receive, send: Send) -> None:
    """The handler as a bare ASGI application (uvicorn, granian ASGI)."""
    kind = scope["type"]
    if kind == "websocket":
        await _asgi_websocket(scope, receive, send)
    elif kind == "http":
        await _asgi_http(scope, receive, send)
    elif kind == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _asgi_websocket(scope: Message, receive: Receive, send: Send) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if scope["path"] != PATH:
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        payload = message.get("bytes")
        # Drop every reference to the frame before awaiting: a name still bound to the last
        # frame keeps 20 kB alive per idle connection (measured: +20 kB each).
        del message
        if payload is not None:
            ack = handle_batch(payload)
            del payload
            await send({"type": "websocket.send", "bytes": ack})


async def _asgi_http(scope: Message, receive: Receive, send: Send) -> None:
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    found = scope["method"] == "POST" and scope["path"] == PATH
    body = handle_batch(b"".join(chunks)) if found else b"not found"
    headers = [(b"content-type", b"application/proto"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200 if found else 404, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RsgiApp:
    """The handler as an RSGI application (granian's own interface)."""

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto == "http":
            body = await protocol()
            if scope.method == "POST" and scope.path == PATH:
                headers = [("content-type", "application/proto")]
                protocol.response_bytes(200, headers, handle_batch(body))
            else:
                protocol.response_bytes(404, [], b"not found")
            return
        if scope.path != PATH:
            protocol.close(1008)
            return
        from granian.rsgi import ProtocolClosed

        transport = await protocol.accept()
        try:
            while True:
                message = await transport.receive()
                if message.kind == 0:  # close
                    break
                ack = handle_batch(message.data) if message.kind == 1 else None
                del message  # not kept alive while waiting for the next frame
                if ack is not None:
                    await transport.send_bytes(ack)
        except ProtocolClosed:
            pass
        protocol.close(1000)


rsgi_app = RsgiApp()


class FloorProtocol(asyncio.Protocol):
    """The reference floor: one bare ``asyncio.Protocol`` per connection on uvloop, with just
    enough hand-written HTTP/1.1 (keep-alive POST, the WebSocket upgrade) and RFC 6455 framing
    for this benchmark. Not a candidate as it stands (no pings, no fragmentation, little
    validation): it shows what a stack costs on top of the event loop."""

    GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    open_connections: ClassVar[set[FloorProtocol]] = set()

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.websocket = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.open_connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open_connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.websocket:
            self._frames()
            return
        assert self.transport is not None
        buffer = self.buffer
        while (end := buffer.find(b"\r\n\r\n")) >= 0:
            lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if method == "GET" and headers.get("upgrade", "").lower() == "websocket":
                del buffer[: end + 4]
                if path != PATH:
                    self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    self.transport.close()
                    return
                digest = hashlib.sha1(headers["sec-websocket-key"].encode() + self.GUID).digest()
                self.transport.write(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
                    + base64.b64encode(digest)
                    + b"\r\n\r\n"
                )
                self.websocket = True
                self._frames()
                return
            length = int(headers.get("content-length", "0"))
            if len(buffer) < end + 4 + length:
                return
            body = bytes(buffer[end + 4 : end + 4 + length])
            del buffer[: end + 4 + length]
            ok = method == "POST" and path == PATH
            ack = handle_batch(body) if ok else b""
            status = b"200 OK" if ok else b"404 Not Found"
            self.transport.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/proto\r\nContent-Length: %d\r\n\r\n%s"
                % (status, len(ack), ack)
            )

    def _frames(self) -> None:
        from websockets.speedups import apply_mask

        assert self.transport is not None
        buffer = self.buffer
        pos, n = 0, len(buffer)
        while n - pos >= 6:
            length, head = buffer[pos + 1] & 0x7F, 2
            if length == 126:
                length, head = int.from_bytes(buffer[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                length, head = int.from_bytes(buffer[pos + 2 : pos + 10], "big"), 10
            if length > MAX_FRAME or not buffer[pos + 1] & 0x80:
                self.going_away(1009 if length > MAX_FRAME else 1002)
                return
            end = pos + head + 4 + length
            if end > n:
                break
            mask = bytes(buffer[pos + head : pos + head + 4])
            payload = apply_mask(bytes(buffer[pos + head + 4 : end]), mask)
            opcode = buffer[pos] & 0x0F
            if opcode == 2:
                ack = handle_batch(payload)
                self.transport.write(bytes((0x82, len(ack))) + ack)
            elif opcode == 9:
                self.transport.write(bytes((0x8A, len(payload))) + payload)
            elif opcode == 8:
                self.transport.write(bytes((0x88, len(payload[:2]))) + payload[:2])
                self.transport.close()
            pos = end
        if pos:
            del buffer[:pos]

    def going_away(self, code: int = 1001) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if self.websocket:
                self.transport.write(b"\x88\x02" + code.to_bytes(2, "big"))
            self.transport.close()


async def _serve_floor(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FloorProtocol, HOST, port, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()  # stop accepting; frames already received were acked in data_received
    for connection in list(FloorProtocol.open_connections):
        connection.going_away()
    await asyncio.sleep(0.1)


def serve(stack: str, port: int, max_seconds: float) -> None:
    """Run one stack's server in this process until SIGTERM, or ``max_seconds``."""
    raise_fd_limit()
    timer = threading.Timer(max_seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
    if stack.startswith("uvicorn-"):
        _serve_uvicorn(stack, port)
    elif stack == "aiohttp":
        _serve_aiohttp(port)
    elif stack.startswith("granian-"):
        _serve_granian(stack, port)
    elif stack == "websockets":
        import uvloop

        uvloop.run(_serve_websockets(port))
    elif stack == "floor":
        import uvloop

        uvloop.run(_serve_floor(port))
    else:
        raise SystemExit(f"unknown stack {stack!r}")


def _serve_uvicorn(stack: str, port: int) -> None:
    import warnings

    import uvicorn

    warnings.simplefilter("ignore", DeprecationWarning)  # the legacy implementation warns
    ws = {"uvicorn-sansio": "websockets-sansio", "uvicorn-legacy": "websockets"}
    config = uvicorn.Config(
        asgi_app,
        host=HOST,
        port=port,
        loop="uvloop",
        http="httptools",
        ws=ws.get(stack, "wsproto"),  # type: ignore[arg-type]
        ws_max_size=MAX_FRAME,
        ws_ping_interval=PING_INTERVAL_S,
        ws_ping_timeout=PING_TIMEOUT_S,
        ws_per_message_deflate=False,
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=4096,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()


def _serve_aiohttp(port: int) -> None:
    import uvloop
    from aiohttp import WSMsgType, web

    async def websocket(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=PING_INTERVAL_S, max_msg_size=MAX_FRAME)
        await ws.prepare(request)
        request.app[sockets].add(ws)
        try:
            async for message in ws:
                ack = handle_batch(message.data) if message.type == WSMsgType.BINARY else None
                del message  # not kept alive while waiting for the next frame
                if ack is not None:
                    await ws.send_bytes(ack)
        finally:
            request.app[sockets].discard(ws)
        return ws

    async def post(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=handle_batch(body), content_type="application/proto")

    async def going_away(app: web.Application) -> None:
        for ws in list(app[sockets]):
            await ws.close(code=1001, message=b"server shutdown")

    sockets = web.AppKey("sockets", set[web.WebSocketResponse])
    app = web.Application(client_max_size=MAX_FRAME)
    app[sockets] = set()
    app.router.add_get(PATH, websocket)
    app.router.add_post(PATH, post)
    app.on_shutdown.append(going_away)
    web.run_app(
        app,
        host=HOST,
        port=port,
        access_log=None,
        backlog=4096,
        print=None,
        shutdown_timeout=5,
        loop=uvloop.new_event_loop(),
    )


def _serve_granian(stack: str, port: int) -> None:
    from granian.constants import Interfaces, Loops
    from granian.log import LogLevels
    from granian.server import Server

    rsgi = stack == "granian-rsgi"
    Server(
        target="stack_choice:rsgi_app" if rsgi else "stack_choice:asgi_app",
        address=HOST,
        port=port,
        interface=Interfaces.RSGI if rsgi else Interfaces.ASGI,
        workers=1,
        runtime_threads=1,
        loop=Loops.uvloop,
        backlog=4096,
        log_level=LogLevels.warning,
        log_access=False,
        workers_kill_timeout=10,
    ).serve()


async def _serve_websockets(port: int) -> None:
    from websockets.asyncio.server import ServerConnection
    from websockets.asyncio.server import serve as ws_serve
    from websockets.exceptions import ConnectionClosed

    async def handler(connection: ServerConnection) -> None:
        if connection.request is None or connection.request.path != PATH:
            await connection.close(1008)
            return
        with contextlib.suppress(ConnectionClosed):
            async for message in connection:
                ack = handle_batch(message) if isinstance(message, bytes) else None
                del message  # not kept alive while waiting for the next frame
                if ack is not None:
                    await connection.send(ack)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with ws_serve(
        handler,
        HOST,
        port,
        compression=None,
        max_size=MAX_FRAME,
        ping_interval=PING_INTERVAL_S,
        ping_timeout=PING_TIMEOUT_S,
        backlog=4096,
    ):
        await stop.wait()
    # leaving the block closes the listener, then every connection with 1001, and waits


# -- a raw WebSocket client for load generation --------------------------------------------------
def masked_frame(opcode: int, payload: bytes, mask: bytes) -> bytes:
    """A final client frame: header, masking key, masked payload."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    key = (mask * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")
    return head + mask + masked


def batch_payload(seed: int = 7) -> bytes:
    rng = random.Random(seed)
    return b"".join(rng.randbytes(EVENT_BYTES) for _ in range(EVENTS_PER_BATCH))


class RawWebSocket(asyncio.Protocol):
    """Just enough of a WebSocket client to load a server: the handshake, pre-built frames out,
    server frames parsed (binary frames are acks; pings answered; close recorded)."""

    def __init__(self, port: int, user: str, mask: bytes) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        self.request = (
            f"GET {PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"X-User-ID: {user}\r\nUser-Agent: stack-choice\r\n\r\n"
        ).encode()
        self.mask = mask
        loop = asyncio.get_running_loop()
        self.upgraded: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.close_code: int | None = None
        self.sent: deque[float] = deque()
        self._buffer = bytearray()
        self._open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError(f"lost before the upgrade: {exc}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def send(self, frame: bytes) -> None:
        assert self.transport is not None
        self.transport.write(frame)
        self.sent.append(time.perf_counter())

    def on_ack(self) -> None:
        """One binary frame from the server."""

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._open:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(buffer[: buffer.find(b"\r\n")])
            del buffer[: end + 4]
            if not status.startswith(b"HTTP/1.1 101"):
                self.upgraded.set_exception(ConnectionError(status.decode(errors="replace")))
                assert self.transport is not None
                self.transport.close()
                return
            self._open = True
            self.upgraded.set_result(None)
        pos, n = 0, len(buffer)
        while n - pos >= 2:
            length, head = buffer[pos + 1] & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, head = int.from_bytes(buffer[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, head = int.from_bytes(buffer[pos + 2 : pos + 10], "big"), 10
            end = pos + head + length
            if end > n:
                break
            opcode = buffer[pos] & 0x0F
            if opcode == 2:
                self.on_ack()
            elif opcode == 9:  # ping: answer with a pong carrying the same data
                payload = bytes(buffer[pos + head : end])
                assert self.transport is not None
                self.transport.write(masked_frame(0xA, payload, self.mask))
            elif opcode == 8:
                payload = bytes(buffer[pos + head : end])
                self.close_code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
                assert self.transport is not None
                self.transport.write(masked_frame(8, payload[:2], self.mask))
                self.transport.close()
            pos = end
        if pos:
            del buffer[:pos]

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(masked_frame(8, (1000).to_bytes(2, "big"), self.mask))
            self.transport.close()


async def open_connections(
    factory: Callable[[int], RawWebSocket],
    count: int,
    port: int,
    source: str | None,
    deadline_s: float,
    parallel: int = 256,
) -> tuple[list[RawWebSocket], list[str]]:
    """Open ``count`` upgraded connections, ``parallel`` handshakes at a time."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(parallel)
    opened: list[RawWebSocket] = []
    errors: list[str] = []
    local = (source, 0) if source else None

    async def one(i: int) -> None:
        async with gate:
            try:
                _, protocol = await loop.create_connection(
                    lambda: factory(i), HOST, port, local_addr=local
                )
                await protocol.upgraded
                opened.append(protocol)
            except (OSError, ConnectionError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), deadline_s)
    return opened, errors


# -- load generator process ------------------------------------------------------------------------
class Generator:
    """Closed loop (every connection keeps ``IN_FLIGHT`` frames outstanding, as fast as the
    server acks) or paced (a fixed rate over all connections, at most ``IN_FLIGHT`` each)."""

    def __init__(self) -> None:
        self.sending = False
        self.paced = False
        self.window = (float("inf"), float("inf"))
        self.latencies: list[float] = []
        self.frame = b""


class LoadConnection(RawWebSocket):
    generator: Generator

    def on_ack(self) -> None:
        now = time.perf_counter()
        sent = self.sent.popleft()
        generator = self.generator
        start, end = generator.window
        if start <= now < end:
            generator.latencies.append(now - sent)
        if generator.sending and not generator.paced:
            self.send(generator.frame)


async def pace(generator: Generator, connections: Sequence[RawWebSocket], rate: float) -> None:
    """Send ``rate`` frames/s round-robin over the connections, skipping full ones."""
    start, sent, i, n = time.perf_counter(), 0, 0, len(connections)
    while generator.sending:
        due = int((time.perf_counter() - start) * rate) - sent
        skipped = 0
        while due > 0 and skipped < n:
            connection = connections[i % n]
            i += 1
            if len(connection.sent) < IN_FLIGHT:
                connection.send(generator.frame)
                sent, due, skipped = sent + 1, due - 1, 0
            else:
                skipped += 1
        if skipped >= n:  # every connection is full: the server is behind, drop the debt
            start, sent = time.perf_counter(), 0
        await asyncio.sleep(0.001)


async def run_load(args: argparse.Namespace) -> None:
    mask = os.urandom(4)
    generator = Generator()
    generator.frame = masked_frame(2, batch_payload(), mask)
    LoadConnection.generator = generator

    def factory(i: int) -> RawWebSocket:
        return LoadConnection(args.port, f"load-{args.index}-{i}", mask)

    opened, errors = await open_connections(
        factory, args.connections, args.port, args.source, deadline_s=60
    )
    emit_line({"ready": len(opened), "errors": errors[:5], "error_count": len(errors)})
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    go = time.perf_counter()
    generator.window = (go + args.warmup, go + args.warmup + args.duration)
    generator.sending = True
    generator.paced = args.rate > 0
    if generator.paced:
        pacer = asyncio.create_task(pace(generator, opened, args.rate))
    else:
        for connection in opened:
            for _ in range(IN_FLIGHT):
                connection.send(generator.frame)
    await asyncio.sleep(args.warmup)
    cpu0 = time.process_time()
    await asyncio.sleep(args.duration)
    cpu1 = time.process_time()
    generator.sending = False
    if generator.paced:
        await pacer
    drain_until = time.perf_counter() + 3
    while time.perf_counter() < drain_until and any(c.sent for c in opened):
        await asyncio.sleep(0.05)
    lost = sum(1 for c in opened if c.lost.done())
    for connection in opened:
        connection.close()
    await asyncio.sleep(0.2)
    emit_line(
        {
            "frames": len(generator.latencies),
            "latencies_us": [round(x * 1e6) for x in generator.latencies],
            "cpu_s": cpu1 - cpu0,
            "window_s": args.duration,
            "lost": lost,
            "unacked": sum(len(c.sent) for c in opened),
        }
    )


async def run_idle(args: argparse.Namespace) -> None:
    """Hold connections open and idle until told to stop (or ``--max-seconds``)."""
    mask = os.urandom(4)
    frame = masked_frame(2, batch_payload(), mask) if args.frames_each else b""

    class Idle(RawWebSocket):
        acked: asyncio.Event | None = None

        def on_ack(self) -> None:
            self.sent.popleft()
            if self.acked is not None:
                self.acked.set()

    def factory(i: int) -> RawWebSocket:
        return Idle(args.port, f"idle-{args.index}-{i}", mask)

    opened, errors = await open_connections(
        factory, args.connections, args.port, args.source, deadline_s=args.max_seconds / 2
    )
    if frame:
        # one batch per connection, a few at a time: what stays is per-connection retention,
        # not the high-water mark of many batches in flight at once
        gate = asyncio.Semaphore(8)

        async def one_batch(connection: RawWebSocket) -> None:
            assert isinstance(connection, Idle)
            async with gate:
                connection.acked = asyncio.Event()
                connection.send(frame)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(connection.acked.wait(), 10)
                connection.acked = None

        await asyncio.gather(*(one_batch(c) for c in opened))
    alive = sum(1 for c in opened if not c.lost.done())
    unacked = sum(len(c.sent) for c in opened)
    emit_line(
        {"ready": alive, "errors": errors[:5], "error_count": len(errors), "unacked": unacked}
    )
    loop = asyncio.get_running_loop()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), args.max_seconds)
    for connection in opened:
        if connection.transport is not None:
            connection.transport.abort()
    emit_line({"done": True})


def emit_line(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


# -- processes, CPU and memory -----------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CHILDREN: list[subprocess.Popen[bytes]] = []


def raise_fd_limit(want: int = 65536) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limits in ((want, max(want, hard)), (min(want, hard), hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return limits[0]
        except (ValueError, OSError):
            continue
    return soft


SERVER_LOGS: dict[int, IO[bytes]] = {}


def spawn(command: Sequence[str], *, log: bool = False) -> subprocess.Popen[bytes]:
    """A child in its own process group (so that its workers die with it). With ``log``, its
    stderr goes to a temporary file (servers log every connection a client drops)."""
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR), PYTHONWARNINGS="ignore")
    stderr = tempfile.TemporaryFile() if log else None  # noqa: SIM115 (closed by stop_server)
    proc = subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        start_new_session=True,
    )
    if stderr is not None:
        SERVER_LOGS[proc.pid] = stderr
    CHILDREN.append(proc)
    return proc


def log_tail(proc: subprocess.Popen[bytes], size: int = 600) -> str:
    log = SERVER_LOGS.get(proc.pid)
    if log is None:
        return ""
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - size))
    return log.read().decode(errors="replace").strip()


def role_command(role: str, **options: object) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role]
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    return command


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def read_json_line(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"pid {proc.pid}: no answer within {timeout_s:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"pid {proc.pid} exited (code {proc.poll()})")
    result: dict[str, Any] = json.loads(line)
    return result


def tell(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(line.encode() + b"\n")
        proc.stdin.flush()


def process_tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
    return pids


@dataclass
class Sample:
    cpu_s: float  # user + system time of the process tree, all threads
    rss_mb: float  # resident set of the process tree, MB (10^6 bytes)
    busy: tuple[int, int]  # the machine's (busy, total) jiffies


def sample(pid: int) -> Sample:
    cpu, rss_kb = 0.0, 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kb += int(line.split()[1])
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    total = sum(ticks)
    return Sample(cpu, rss_kb * 1024 / 1e6, (total - ticks[3] - ticks[4], total))


def machine_busy(a: Sample, b: Sample) -> float:
    dt = b.busy[1] - a.busy[1]
    return (b.busy[0] - a.busy[0]) / dt if dt else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}: {log_tail(proc)}")
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on port {port} after {timeout_s} s")


@contextlib.contextmanager
def running_server(stack: str, max_seconds: float) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = spawn(role_command("server", stack=stack, port=port, max_seconds=max_seconds), log=True)
    try:
        wait_listening(port, proc)
        time.sleep(0.5)  # let a multi-process server (granian) finish starting its worker
        yield proc, port
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> float:
    """SIGTERM, wait; SIGKILL the group if it does not stop. Returns the seconds it took."""
    start = time.monotonic()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
    kill_group(proc)  # stray workers
    log = SERVER_LOGS.pop(proc.pid, None)
    if log is not None:
        log.close()
    return time.monotonic() - start


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))
    return ordered[rank]


# -- the scenarios ---------------------------------------------------------------------------------
@dataclass
class WsFigures:
    stack: str
    connections: int
    load: str  # "closed" (4 in flight, as fast as acked) or the paced rate in events/s
    frames_per_s: float = float("nan")
    events_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p95_ms: float = float("nan")
    p99_ms: float = float("nan")
    server_cpu_pct: float = float("nan")
    server_rss_mb: float = float("nan")
    server_us_per_frame: float = float("nan")  # server CPU per acked frame
    generator_cpu_pct: float = float("nan")
    machine_busy_pct: float = float("nan")
    rounds: str = ""  # frames/s of each round (the other figures are medians over rounds)
    note: str = ""


@dataclass
class IdleFigures:
    stack: str
    mode: str  # "handshake" or "one batch"
    connections: int = 0
    baseline_mb: float = float("nan")
    rss_mb: float = float("nan")
    per_connection_kb: float = float("nan")
    rss_at_10k_mb: float = float("nan")  # baseline + 10,000 x per connection
    note: str = ""


@dataclass
class RestFigures:
    stack: str
    requests_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    server_cpu_pct: float = float("nan")
    server_us_per_request: float = float("nan")
    client_cpu_pct: float = float("nan")
    rounds: str = ""  # requests/s of each round (the other figures are medians over rounds)
    note: str = ""


@dataclass
class ShutdownFigures:
    stack: str
    close_code: str = "-"
    in_flight_acked: str = "-"
    exit_s: float = float("nan")
    note: str = ""


@dataclass
class Settings:
    connections: tuple[int, ...]
    warmup_s: float
    duration_s: float
    idle_connections: int
    generators: int
    rest_duration_s: int
    rounds: int
    paced_events_per_s: tuple[float, ...] = (150_000, 300_000)  # the target, stretch


def ws_throughput(
    stack: str,
    proc: subprocess.Popen[bytes],
    port: int,
    connections: int,
    cfg: Settings,
    events_per_s: float = 0,
) -> WsFigures:
    """Closed loop, or paced at ``events_per_s`` (events, not frames) over all connections."""
    load = f"paced {events_per_s / 1000:g}k/s" if events_per_s else "closed"
    figures = WsFigures(stack, connections, load)
    count = cfg.generators if connections >= 2 * cfg.generators else 1
    shares = [connections // count + (i < connections % count) for i in range(count)]
    frames_per_s = events_per_s / EVENTS_PER_BATCH
    generators = [
        spawn(
            role_command(
                "load",
                port=port,
                connections=share,
                index=i,
                warmup=cfg.warmup_s,
                duration=cfg.duration_s,
                rate=frames_per_s * share / connections,
            )
        )
        for i, share in enumerate(shares)
    ]
    try:
        ready = [read_json_line(g, 90) for g in generators]
        opened = sum(r["ready"] for r in ready)
        if opened < connections:
            errors = sum(r["error_count"] for r in ready)
            figures.note = (
                f"{opened}/{connections} opened ({errors} errors: {ready[0]['errors'][:1]})"
            )
            if not opened:
                return figures
        for g in generators:
            tell(g, "go")
        time.sleep(cfg.warmup_s)
        before = sample(proc.pid)
        time.sleep(cfg.duration_s)
        after = sample(proc.pid)
        results = [read_json_line(g, 30) for g in generators]
    finally:
        for g in generators:
            with contextlib.suppress(subprocess.TimeoutExpired):
                g.wait(10)
            kill_group(g)
    latencies = sorted(x for r in results for x in r["latencies_us"])
    frames = sum(r["frames"] for r in results)
    figures.frames_per_s = frames / cfg.duration_s
    figures.events_per_s = figures.frames_per_s * EVENTS_PER_BATCH
    figures.p50_ms, figures.p95_ms, figures.p99_ms = (
        percentile(latencies, q) / 1000 for q in (50, 95, 99)
    )
    figures.server_cpu_pct = (after.cpu_s - before.cpu_s) / cfg.duration_s * 100
    if frames:
        figures.server_us_per_frame = (after.cpu_s - before.cpu_s) / frames * 1e6
    figures.server_rss_mb = after.rss_mb
    figures.generator_cpu_pct = sum(r["cpu_s"] for r in results) / cfg.duration_s * 100
    figures.machine_busy_pct = machine_busy(before, after) * 100
    lost = sum(r["lost"] for r in results)
    if lost:
        figures.note += f" {lost} connections closed by the server"
    return figures


def idle_memory(stack: str, mode: str, cfg: Settings, max_seconds: float) -> IdleFigures:
    figures = IdleFigures(stack, mode)
    frames_each = 1 if mode == "one batch" else 0
    with running_server(stack, max_seconds) as (proc, port):
        # warm the server up (lazy imports, first buffers) before the baseline
        warm = spawn(
            role_command("idle", port=port, connections=20, frames_each=1, index=9, max_seconds=60)
        )
        read_json_line(warm, 60)
        tell(warm, "stop")
        read_json_line(warm, 30)
        kill_group(warm)
        time.sleep(1.5)
        figures.baseline_mb = sample(proc.pid).rss_mb
        shares = [cfg.idle_connections // 2, cfg.idle_connections - cfg.idle_connections // 2]
        holders = [
            spawn(
                role_command(
                    "idle",
                    port=port,
                    connections=share,
                    frames_each=frames_each,
                    index=i,
                    source=f"127.0.0.{10 + i}",
                    max_seconds=max_seconds,
                )
            )
            for i, share in enumerate(shares)
        ]
        try:
            ready = [read_json_line(h, max_seconds) for h in holders]
            figures.connections = sum(r["ready"] for r in ready)
            errors = sum(r["error_count"] for r in ready)
            unacked = sum(r["unacked"] for r in ready)
            if errors or unacked:
                figures.note = f"{errors} connect errors, {unacked} batches unacked"
            time.sleep(3)  # let the server settle (timers, buffers)
            figures.rss_mb = sample(proc.pid).rss_mb
            for h in holders:
                tell(h, "stop")
        finally:
            for h in holders:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(15)
                kill_group(h)
    if figures.connections:
        per_mb = (figures.rss_mb - figures.baseline_mb) / figures.connections
        figures.per_connection_kb = per_mb * 1000
        figures.rss_at_10k_mb = figures.baseline_mb + 10_000 * per_mb
    return figures


WRK_SCRIPT = f"""
wrk.method = "POST"
wrk.body = string.rep("e", {BATCH_BYTES})
wrk.headers["Content-Type"] = "application/proto"
wrk.headers["X-User-ID"] = "rest"
"""


def rest_throughput(
    stack: str, proc: subprocess.Popen[bytes], port: int, cfg: Settings
) -> RestFigures:
    figures = RestFigures(stack)
    wrk = shutil.which("wrk")
    if wrk is None:
        figures.note = "wrk not installed (apt-get install wrk)"
        return figures
    with tempfile.TemporaryDirectory(prefix="stack-choice-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT)
        out = Path(tmp) / "wrk.out"
        command = [wrk, "-t1", "-c50", f"-d{cfg.rest_duration_s}s", "--latency", "-s", str(script)]
        command.append(f"http://{HOST}:{port}{PATH}")
        before = sample(proc.pid)
        with open(out, "wb") as sink:
            child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        until = time.monotonic() + cfg.rest_duration_s + 30
        status, usage = 0, None
        while time.monotonic() < until:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.1)
        else:
            child.kill()
            figures.note = "wrk did not finish"
            return figures
        after = sample(proc.pid)
        text = out.read_text()
    wall = float(cfg.rest_duration_s)
    match = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not match or status != 0 or usage is None:
        figures.note = f"wrk failed: {text.strip()[-200:]}"
        return figures
    figures.requests_per_s = float(match.group(1))
    figures.server_cpu_pct = (after.cpu_s - before.cpu_s) / wall * 100
    figures.server_us_per_request = (
        (after.cpu_s - before.cpu_s) / (figures.requests_per_s * wall) * 1e6
    )
    figures.client_cpu_pct = (usage.ru_utime + usage.ru_stime) / wall * 100
    for q, name in ((50, "p50_ms"), (99, "p99_ms")):
        found = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if found:
            scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[found.group(2)]
            setattr(figures, name, float(found.group(1)) * scale)
    for pattern in (r"Non-2xx or 3xx responses: \d+", r"Socket errors:.*"):
        found = re.search(pattern, text)
        if found:
            figures.note += found.group(0) + " "
    return figures


async def _probe_shutdown(port: int, pid: int) -> tuple[int | None, int, bool]:
    """One connection, 4 frames in flight, then SIGTERM: (close code, in-flight acked, EOF)."""
    mask = os.urandom(4)
    frame = masked_frame(2, batch_payload(), mask)

    class Probe(RawWebSocket):
        acked = 0

        def on_ack(self) -> None:
            self.sent.popleft()
            self.acked += 1

    loop = asyncio.get_running_loop()
    _, probe = await loop.create_connection(lambda: Probe(port, "probe", mask), HOST, port)
    await asyncio.wait_for(probe.upgraded, 10)
    probe.send(frame)
    until = time.monotonic() + 10
    while probe.sent and time.monotonic() < until:
        await asyncio.sleep(0.01)
    probe.acked = 0
    for _ in range(IN_FLIGHT):
        probe.send(frame)
    os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(probe.lost), 15)
    if probe.transport is not None:
        probe.transport.abort()
    return probe.close_code, probe.acked, probe.lost.done()


def shutdown_behaviour(stack: str, max_seconds: float) -> ShutdownFigures:
    figures = ShutdownFigures(stack)
    port = free_port()
    proc = spawn(role_command("server", stack=stack, port=port, max_seconds=max_seconds), log=True)
    try:
        wait_listening(port, proc)
        time.sleep(0.5)
        start = time.monotonic()
        code, acked, ended = asyncio.run(_probe_shutdown(port, proc.pid))
        figures.close_code = str(code) if code is not None else ("none (EOF)" if ended else "open")
        figures.in_flight_acked = f"{acked}/{IN_FLIGHT}"
        try:
            proc.wait(20)
            figures.exit_s = time.monotonic() - start
        except subprocess.TimeoutExpired:
            figures.note = "did not exit within 20 s"
    except (OSError, ConnectionError, TimeoutError, RuntimeError) as exc:
        figures.note = f"{type(exc).__name__}: {exc}"
    finally:
        stop_server(proc)
    return figures


def grpc_check() -> str:
    """Run a grpc.aio server and client in one uvloop event loop; report what happened."""
    command = [sys.executable, str(Path(__file__).resolve()), "--role", "grpc"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=60, text=True)
    except subprocess.TimeoutExpired:
        return "timed out"
    return (done.stdout.strip() or done.stderr.strip()[-300:]) or f"exit {done.returncode}"


async def _grpc_in_uvloop() -> str:
    import grpc

    def same(data: bytes) -> bytes:
        return data

    async def send_event(request: bytes, context: Any) -> bytes:
        return handle_batch(request)

    handler = grpc.method_handlers_generic_handler(
        "raystack.raccoon.v1beta1.EventService",
        {"SendEvent": grpc.unary_unary_rpc_method_handler(send_event, same, same)},
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{HOST}:0")
    await server.start()
    calls = 500
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        send = channel.unary_unary(
            "/raystack.raccoon.v1beta1.EventService/SendEvent",
            request_serializer=same,
            response_deserializer=same,
        )
        payload = batch_payload()
        start = time.perf_counter()
        for _ in range(calls):
            reply = await send(payload)
        elapsed = time.perf_counter() - start
    await server.stop(1)
    loop = type(asyncio.get_running_loop())
    ok = "ok" if reply == ACK else "wrong reply"
    return f"{ok}: grpc.aio server + client in {loop.__module__}.{loop.__name__}, " + (
        f"{calls / elapsed:,.0f} sequential unary calls/s of 20 kB"
    )


# -- the report -----------------------------------------------------------------------------------
def fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value) if value not in (None, "") else ""


def markdown_table(rows: Sequence[object]) -> str:
    if not rows:
        return "(none)"
    dicts = [asdict(row) for row in rows]  # type: ignore[call-overload]
    headers = list(dicts[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(d[h]) for h in headers) + " |" for d in dicts]
    return "\n".join(lines)


@dataclass
class Report:
    settings: Settings
    machine: dict[str, Any]
    versions: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)
    websocket: list[WsFigures] = field(default_factory=list)
    idle: list[IdleFigures] = field(default_factory=list)
    rest: list[RestFigures] = field(default_factory=list)
    shutdown: list[ShutdownFigures] = field(default_factory=list)
    websocket_rounds: list[WsFigures] = field(default_factory=list)
    rest_rounds: list[RestFigures] = field(default_factory=list)
    grpc: str = ""


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for name in ("uvicorn", "uvloop", "httptools", "websockets", "wsproto", "aiohttp", "granian"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    wrk = shutil.which("wrk")
    found["wrk"] = wrk or "absent"
    return found


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return {"cpus": os.cpu_count(), "cpu_model": model, "kernel": os.uname().release}


def available(stack: str) -> str | None:
    import importlib.util

    missing = [m for m in STACK_MODULES[stack] if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def run(stacks: Sequence[str], cfg: Settings) -> Report:
    report = Report(cfg, machine(), versions())
    report.grpc = grpc_check()
    progress(f"grpc.aio on uvloop: {report.grpc}")
    for stack in stacks:
        reason = available(stack)
        if reason:
            report.skipped[stack] = reason
            progress(f"{stack}: skipped ({reason})")
    ready = [s for s in stacks if s not in report.skipped]
    # Throughput in rounds, the stacks in a different order each round, so that a slow spell
    # of this (virtual) machine does not land on one stack only; medians over the rounds.
    for number in range(cfg.rounds):
        order = ready[number % len(ready) :] + ready[: number % len(ready)] if ready else []
        for stack in order:
            progress(f"round {number + 1}/{cfg.rounds}: {stack}")
            try:
                throughput_round(stack, cfg, report)
            except (OSError, RuntimeError, TimeoutError) as exc:
                report.skipped[stack] = f"failed: {type(exc).__name__}: {exc}"
                progress(f"{stack}: failed: {exc}")
    report.websocket = [
        median_row(rows, "frames_per_s") for rows in grouped(report.websocket_rounds)
    ]
    report.rest = [median_row(rows, "requests_per_s") for rows in grouped(report.rest_rounds)]
    for stack in ready:
        try:
            for mode in ("handshake", "one batch"):
                progress(f"{stack}: {cfg.idle_connections:,} idle connections ({mode})")
                idle = idle_memory(stack, mode, cfg, 240)
                report.idle.append(idle)
                progress(
                    f"  {fmt(idle.per_connection_kb)} kB/connection, "
                    f"{fmt(idle.rss_at_10k_mb)} MB at 10k {idle.note}"
                )
            progress(f"{stack}: graceful shutdown probe")
            report.shutdown.append(shutdown_behaviour(stack, 120))
        except (OSError, RuntimeError, TimeoutError) as exc:
            report.skipped[stack] = f"failed: {type(exc).__name__}: {exc}"
            progress(f"{stack}: failed: {exc}")
    return report


def throughput_round(stack: str, cfg: Settings, report: Report) -> None:
    scenarios = len(cfg.connections) + len(cfg.paced_events_per_s)
    per_server_s = 60 + scenarios * (90 + cfg.warmup_s + cfg.duration_s)
    with running_server(stack, per_server_s + cfg.rest_duration_s) as (proc, port):
        runs = [(n, 0.0) for n in cfg.connections]
        runs += [(cfg.connections[-1], rate) for rate in cfg.paced_events_per_s]
        for n, rate in runs:
            row = ws_throughput(stack, proc, port, n, cfg, rate)
            report.websocket_rounds.append(row)
            progress(
                f"  WebSocket x{n} {row.load}: {fmt(row.events_per_s)} events/s, "
                f"p95 {fmt(row.p95_ms)} ms, "
                f"server {fmt(row.server_us_per_frame)} us/frame, CPU {fmt(row.server_cpu_pct)}%, "
                f"generator CPU {fmt(row.generator_cpu_pct)}% {row.note}"
            )
        if stack not in NO_REST:
            rest = rest_throughput(stack, proc, port, cfg)
            report.rest_rounds.append(rest)
            progress(
                f"  REST: {fmt(rest.requests_per_s)} requests/s, "
                f"server {fmt(rest.server_us_per_request)} us/request {rest.note}"
            )


def grouped(rows: Sequence[Any]) -> list[list[Any]]:
    """Rows of the same stack (and connection count), in first-seen order."""
    groups: dict[tuple[str, int, str], list[Any]] = {}
    for row in rows:
        key = (row.stack, getattr(row, "connections", 0), getattr(row, "load", ""))
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def median_row(rows: Sequence[Any], rate: str) -> Any:
    """One row of medians over rounds; ``rounds`` lists each round's ``rate``."""
    merged = dict(asdict(rows[0]))
    for name, value in merged.items():
        if isinstance(value, float):
            values = sorted(v for r in rows if (v := getattr(r, name)) == v)
            merged[name] = statistics.median(values) if values else float("nan")
    merged["rounds"] = " / ".join(fmt(getattr(r, rate)) for r in rows)
    merged["note"] = " ".join(sorted({r.note.strip() for r in rows if r.note.strip()}))
    return type(rows[0])(**merged)


def print_report(report: Report) -> None:
    cfg = report.settings
    m = report.machine
    print(f"# Server stacks for the collector ({m['cpus']} CPUs, {m['cpu_model']})\n")
    print(
        "Loopback only. The load generators and wrk run on the same machine as the server and "
        "share its cores: the figures are lower bounds for a server with the machine to itself.\n"
    )
    print("Versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()) + "\n")
    print(
        f"## WebSocket: 20 kB frames (100 events), at most {IN_FLIGHT} in flight per connection, "
        f"{cfg.duration_s:g} s after {cfg.warmup_s:g} s warm-up, medians of {cfg.rounds} rounds\n"
    )
    print(
        "`closed`: every connection keeps 4 frames in flight, as fast as the server acks "
        "(saturation; latency is then mostly queueing). `paced`: a fixed total rate spread over "
        "the connections (latency and CPU at that load).\n"
    )
    print(markdown_table(report.websocket) + "\n")
    print(f"## Idle connections: server RSS with {cfg.idle_connections:,} open\n")
    print(markdown_table(report.idle) + "\n")
    print(f"## REST: POST of 20 kB, keep-alive, 50 connections, wrk, {cfg.rest_duration_s} s\n")
    print(markdown_table(report.rest) + "\n")
    print("## Graceful shutdown: SIGTERM with 4 frames in flight on one connection\n")
    print(markdown_table(report.shutdown) + "\n")
    print(f"## grpc.aio in a uvloop event loop\n\n{report.grpc}\n")
    for stack, reason in report.skipped.items():
        print(f"* {stack}: {reason}")


# -- entry point ----------------------------------------------------------------------------------
def watchdog(limit_s: float) -> None:
    def expire() -> None:
        progress(f"hard time limit of {limit_s:.0f} s reached: stopping everything")
        for proc in CHILDREN:
            kill_group(proc)
        os._exit(3)

    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    timer.start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, about 3 minutes")
    parser.add_argument(
        "--stacks", default=",".join(STACKS), help="comma-separated, of: " + ", ".join(STACKS)
    )
    parser.add_argument("--generators", type=int, default=1, help="load generator processes")
    parser.add_argument("--rounds", type=int, help="throughput rounds (default 3, --quick 1)")
    parser.add_argument("--format", choices=("markdown", "json"), default="markdown")
    parser.add_argument("--time-limit", type=float, help="hard limit in seconds for the run")
    # internal: the child process roles
    parser.add_argument(
        "--role", choices=("server", "load", "idle", "grpc"), help=argparse.SUPPRESS
    )
    parser.add_argument("--stack", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--frames-each", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-seconds", type=float, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.role == "server":
        serve(args.stack, args.port, args.max_seconds)
        return 0
    if args.role in ("load", "idle"):
        import uvloop

        raise_fd_limit()
        guard = threading.Timer(args.max_seconds + 120, os._exit, (4,))  # never outlive the run
        guard.daemon = True
        guard.start()
        uvloop.run(run_load(args) if args.role == "load" else run_idle(args))
        os._exit(0)  # the stdin reader thread may still be blocked
    if args.role == "grpc":
        import uvloop

        print(uvloop.run(_grpc_in_uvloop()))
        return 0

    stacks = [s for s in args.stacks.split(",") if s]
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        parser.error(f"unknown stacks: {', '.join(unknown)}")
    if args.quick:
        cfg = Settings((1, 50, 200), 1.0, 3.0, 2_000, args.generators, 3, args.rounds or 1)
    else:
        cfg = Settings((1, 50, 1000), 2.0, 10.0, 10_000, args.generators, 10, args.rounds or 3)
    scenarios = len(cfg.connections) + len(cfg.paced_events_per_s)
    per_round = 30 + 20 * scenarios + cfg.rest_duration_s if args.quick else 40 * scenarios
    limit = args.time_limit or 300 + len(stacks) * (per_round * cfg.rounds + 150)
    watchdog(limit)
    limit_fds = raise_fd_limit()
    progress(f"{len(stacks)} stacks, hard limit {limit:.0f} s, fd limit {limit_fds}")
    try:
        report = run(stacks, cfg)
    finally:
        for proc in CHILDREN:
            if proc.poll() is None:
                kill_group(proc)
    if args.format == "json":
        json.dump(asdict(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
