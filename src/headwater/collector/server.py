"""The collector's servers: HTTP + WebSocket on aiohttp, and gRPC on its own port.

aiohttp was chosen by measurement (``docs/server-stack.md``): the lightest WebSocket connections
(about 15 KB each idle), the fastest WebSocket path, and a clean close with code 1001 on
shutdown.

WebSocket connections are kept alive by one task for all of them: every ``ping_interval_s`` it
pings each connection and closes those that have sent nothing (not even a pong) for
``pong_wait_s``. Client pings are answered. Each connection handles up to ``MAX_IN_FLIGHT``
requests at once; responses go back as they complete, each naming its ``req_guid``.

Shutdown (``stop``): new connections and requests are refused, in-flight requests finish, open
WebSockets are closed with 1001 (going away), then the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from headwater.collector.deadline import TIMEOUT_RESPONSE, HeadDeadline
from headwater.collector.errors import Rejected
from headwater.collector.grpc_server import GrpcServer
from headwater.collector.metrics import StatsdExporter
from headwater.collector.protocols import raccoon
from headwater.collector.service import Collector, Connection, HttpRequest

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # requests one WebSocket connection may have outstanding
WS_PATH = "/api/v1/events"


class _Socket:
    """A WebSocket connection's server-side state."""

    __slots__ = ("conn", "in_flight", "last_seen", "ws")  # (no __dict__: memory)

    def __init__(self, ws: web.WebSocketResponse, conn: Connection) -> None:
        self.ws = ws
        self.conn = conn
        self.last_seen = time.monotonic()
        # requests being answered; None while there are none (an idle connection holds no set)
        self.in_flight: set[asyncio.Task[None]] | None = None

    def add(self, task: asyncio.Task[None]) -> None:
        if self.in_flight is None:
            self.in_flight = set()
        self.in_flight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if self.in_flight is not None:
            self.in_flight.discard(task)
            if not self.in_flight:
                self.in_flight = None

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self.in_flight) if self.in_flight else []


class CollectorServer:
    def __init__(
        self,
        collector: Collector,
        host: str,
        port: int,
        grpc_port: int | None,
        echo: Callable[[str], None] = lambda _: None,
        sock: socket.socket | None = None,
    ) -> None:
        self.collector = collector
        self.sock = sock  # a listening socket made for this server (an intake worker's)
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self._echo = echo
        self._sockets: set[_Socket] = set()
        self._runner: web.AppRunner | None = None
        self._grpc: GrpcServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._statsd: StatsdExporter | None = None
        self._listener: asyncio.Server | None = None
        self._deadline = HeadDeadline(
            collector.config.limits.request_timeout_s,
            lambda: collector.metrics.rejected("request_timeout"),
        )

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        limits = self.collector.config.limits
        loop = asyncio.get_running_loop()

        def request(
            message: Any, payload: Any, protocol: Any, writer: Any, task: Any
        ) -> web.BaseRequest:
            size = limits.max_body_bytes
            return web.BaseRequest(
                message, payload, protocol, writer, task, loop, client_max_size=size
            )

        # aiohttp's low-level server (no Application, router or match info: every request comes
        # here, and an idle WebSocket holds less)
        low_level = web.Server(
            self._handle,
            request_factory=request,
            access_log=None,
            max_field_size=16384,
            # The collector undoes content codings itself, within its body limit.
            auto_decompress=False,
        )
        self._runner = web.ServerRunner(
            low_level, handle_signals=False, shutdown_timeout=self.collector.config.shutdown_grace_s
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        # Our own listener (not a TCPSite) so that every connection's request head is timed.
        if self.sock is not None:
            self._listener = await loop.create_server(
                self._deadline.factory(server), sock=self.sock
            )
        else:
            self._listener = await loop.create_server(
                self._deadline.factory(server), self.host, self.port, reuse_address=True
            )
        if self._listener.sockets:
            self.port = self._listener.sockets[0].getsockname()[1]
        if self.grpc_port is not None:
            self._grpc = GrpcServer(
                self.collector.raccoon_grpc,
                self.host,
                self.grpc_port,
                limits.max_body_bytes,
                share_port=self.sock is not None,
            )
            self.grpc_port = await self._grpc.start()
        self._tasks = [
            asyncio.create_task(self._keepalive(), name="ws-keepalive"),
            asyncio.create_task(self.collector.admission.run(), name="admission"),
        ]
        statsd = self.collector.config.statsd
        if statsd is not None:
            self._statsd = StatsdExporter(self.collector.metrics, statsd)
            self._tasks.append(asyncio.create_task(self._statsd.run(), name="statsd"))
        self.collector.ready = True

    async def stop(self) -> None:
        """Stop gracefully: refuse new work, finish in-flight requests, close WebSockets with
        1001, stop the servers."""
        collector = self.collector
        collector.draining = True
        grace = collector.config.shutdown_grace_s
        if self._grpc is not None:
            await self._grpc.stop(grace)
        pending = [t for s in self._sockets for t in s.tasks()]
        if pending:
            await asyncio.wait(pending, timeout=grace)
        for s in list(self._sockets):
            with contextlib.suppress(Exception):
                await s.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        if self._listener is not None:
            self._listener.close()  # stop accepting; open connections are the runner's to end
        if self._runner is not None:
            await self._runner.cleanup()  # stops listening, waits for in-flight HTTP requests
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._statsd is not None:
            self._statsd.flush((collector.config.statsd.host, collector.config.statsd.port))  # type: ignore[union-attr]
            self._statsd.close()
        collector.ready = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- HTTP -------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        handler = request.protocol
        self._deadline.begin(handler)
        try:
            if request.path == WS_PATH and request.method == "GET":
                return await self._websocket(request)
            return await self._http(request)
        finally:
            self._deadline.end(handler)

    async def _http(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.collector.draining and request.method == "POST":
            return web.Response(
                status=503, text="the collector is shutting down\n", headers={"Retry-After": "1"}
            )
        try:
            async with asyncio.timeout(self._deadline.timeout_s):
                body = await request.read() if request.can_read_body else b""
        except TimeoutError:
            self.collector.metrics.rejected("request_timeout")
            return web.Response(
                status=408,
                body=TIMEOUT_RESPONSE.partition(b"\r\n\r\n")[2],
                content_type="text/plain",
                headers={"Connection": "close"},
            )
        except web.HTTPRequestEntityTooLarge:
            self.collector.metrics.rejected("too_large")
            limit = self.collector.config.limits.max_body_bytes
            return web.Response(
                status=413,
                text=f"the body is larger than {limit} bytes (collector.limits.max_body_bytes)\n",
            )
        req = HttpRequest(
            request.method,
            request.path,
            {k.lower(): v for k, v in request.headers.items()},
            body,
            request.remote or "",
            dict(request.query),
        )
        resp = await self.collector.http(req)
        return web.Response(
            status=resp.status,
            body=resp.body,
            headers={"Content-Type": resp.content_type, **dict(resp.headers)},
        )

    # -- WebSocket --------------------------------------------------------------------------
    async def _websocket(self, request: web.BaseRequest) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            conn = await self.collector.open_connection(headers, request.remote or "")
        except Rejected as e:
            return await self._refuse_socket(request, e)
        del headers  # not kept for the connection's life
        ws = web.WebSocketResponse(
            autoping=False, max_msg_size=self.collector.config.limits.max_frame_bytes
        )
        sock = _Socket(ws, conn)
        try:
            await ws.prepare(request)
            self._sockets.add(sock)
            # (the frames are read here, not in a helper coroutine: an idle connection then
            # holds one coroutine frame less)
            while await self._frame(sock, await ws.receive()):
                pass
            if sock.in_flight:  # the client went away: let its requests finish (they are stored)
                await asyncio.wait(sock.tasks())
        finally:
            self._sockets.discard(sock)
            self.collector.close_connection(conn)
        return ws

    async def _refuse_socket(self, request: web.BaseRequest, e: Rejected) -> web.StreamResponse:
        """Over a limit: upgrade, send the refusal as a response with its code, close."""
        self.collector.metrics.rejected(e.kind)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(raccoon.error_response_bytes(e))
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=e.reason[:120].encode())
        return ws

    async def _frame(self, sock: _Socket, msg: WSMessage) -> bool:
        """Handle one frame; False when the connection is over. (The frame is not kept while
        the connection waits for the next: an idle connection holds no batch.)"""
        sock.last_seen = time.monotonic()
        kind = msg.type
        if kind is WSMsgType.BINARY or kind is WSMsgType.TEXT:
            while sock.in_flight and len(sock.in_flight) >= MAX_IN_FLIGHT:  # (no semaphore per
                # connection: memory)
                await asyncio.wait(sock.tasks(), return_when=asyncio.FIRST_COMPLETED)
            sock.add(asyncio.create_task(self._answer(sock, msg.data)))
        elif kind is WSMsgType.PING:
            await sock.ws.pong(msg.data)
        elif kind is WSMsgType.ERROR:
            self._note_error(sock, sock.ws.exception())
            return False
        elif kind is not WSMsgType.PONG:  # CLOSE, CLOSING, CLOSED
            return False
        return True

    def _note_error(self, sock: _Socket, error: BaseException | None) -> None:
        reason = str(error) if error else "unknown"
        kind = (
            "too_large" if "too big" in reason.lower() or "size" in reason.lower() else "ws_error"
        )
        self.collector.metrics.rejected(kind)
        log.info("closing WebSocket of %s: %s", sock.conn.identity, reason)

    async def _answer(self, sock: _Socket, data: bytes | str) -> None:
        try:
            response = await self.collector.raccoon_message(sock.conn, data)
            if not sock.ws.closed:
                if isinstance(response, str):
                    await sock.ws.send_str(response)
                else:
                    await sock.ws.send_bytes(response)
        except ConnectionError:
            pass  # the client left; what it sent was handled

    async def _keepalive(self) -> None:
        cfg = self.collector.config.raccoon
        deadline = cfg.read_timeout_s or cfg.pong_wait_s
        while True:
            await asyncio.sleep(cfg.ping_interval_s)
            now = time.monotonic()
            for sock in list(self._sockets):
                if sock.ws.closed:
                    continue
                try:
                    if now - sock.last_seen > deadline:
                        self.collector.metrics.rejected("pong_timeout")
                        await sock.ws.close(
                            code=WSCloseCode.GOING_AWAY, message=b"no pong within the deadline"
                        )
                    else:
                        await sock.ws.ping()
                except ConnectionError:
                    continue
