"""The collector's servers: HTTP on aiohttp, WebSocket on the collector's own protocol, and
gRPC on its own port.

aiohttp was chosen by measurement (``docs/server-stack.md``). A connection whose first request
is a WebSocket upgrade is taken before aiohttp sees it (``collector.websocket``): an idle
WebSocket then holds no parsed request, parser, queue or task. An upgrade that aiohttp parses
(a later request on a kept-alive connection) is checked by the same handshake and taken from
aiohttp's handler, with the bytes its parser held after the head: every WebSocket connection
is served by the one implementation.

WebSocket connections are kept alive by one task for all of them: every ``ping_interval_s`` it
pings each connection and closes those that have sent nothing (not even a pong) for
``pong_wait_s``. Client pings are answered. Each connection handles up to ``MAX_IN_FLIGHT``
requests at once; responses go back as they complete, each naming its ``req_guid``.

With ``collector.tls`` both ports serve TLS: the HTTP port offers ALPN
``http/1.1`` and the collector's WebSocket takes over the TLS transport as it would a plain one;
the gRPC port offers ``h2``. ``reload_tls`` (SIGHUP) presents the certificate files anew.

Shutdown (``stop``): new connections and requests are refused, in-flight requests finish, open
WebSockets are closed with 1001 (going away), then the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, web
from websockets.http11 import Response

from headwater.collector import websocket
from headwater.collector.deadline import TIMEOUT_RESPONSE, HeadDeadline
from headwater.collector.errors import Rejected
from headwater.collector.grpc_server import GrpcServer, Handle
from headwater.collector.metrics import StatsdExporter
from headwater.collector.protocols import raccoon
from headwater.collector.service import Collector, Connection, HttpRequest
from headwater.collector.tls import H2, HTTP1, ServerCertificate, server_certificate

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # requests one WebSocket connection may have outstanding
WS_PATH = "/api/v1/events"


def _unavailable(text: bytes) -> bytes:
    """A 503 answer to a WebSocket upgrade the collector cannot take now."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
        b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
    )


SHUTTING_DOWN = _unavailable(b"the collector is shutting down\n")
NOT_ADMITTED = _unavailable(b"the collector could not admit this connection; retry shortly\n")


def _request_head(request: web.BaseRequest) -> bytes:
    """A request's head as the client sent it (near enough for the handshake's checks)."""
    version = request.version
    lines = [
        b"%s %s HTTP/%d.%d"
        % (request.method.encode(), request.raw_path.encode(errors="surrogateescape"), *version),
        *(name + b": " + value for name, value in request.raw_headers),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _refusal(answer: Response | None) -> web.Response:
    """A handshake refused (``websocket.handshake``'s response, or None for a request that is
    not one), answered by aiohttp; the connection then closes."""
    if answer is None:
        resp = web.Response(status=400, text="not a WebSocket handshake\n")
    else:
        kept = {k: v for k, v in answer.headers.raw_items() if k.lower() not in _SET_BY_AIOHTTP}
        resp = web.Response(
            status=answer.status_code, reason=answer.reason_phrase, body=answer.body, headers=kept
        )
    resp.force_close()
    return resp


_SET_BY_AIOHTTP = {"connection", "content-length", "date"}


class _Detached(web.StreamResponse):
    """What the handler of an upgrade it took returns: the connection is no longer aiohttp's,
    so nothing is written and nothing closed."""

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


class _Socket(websocket.Listener):
    """A WebSocket connection's server-side state (``ws``: the collector's own
    ``websocket.WebSocket``)."""

    __slots__ = ("backlog", "conn", "in_flight", "last_seen", "server", "ws")  # (no __dict__)

    def __init__(self, server: CollectorServer, conn: Connection | None) -> None:
        self.server = server
        self.conn = conn  # None until the connection is admitted
        self.ws: websocket.WebSocket = None  # type: ignore[assignment]  # (set at once)
        self.last_seen = time.monotonic()
        # requests being answered; None while there are none (an idle connection holds no set)
        self.in_flight: set[asyncio.Task[None]] | None = None
        # messages read while MAX_IN_FLIGHT are being answered (reading is paused meanwhile)
        self.backlog: deque[bytes | str] | None = None

    def add(self, task: asyncio.Task[None]) -> None:
        if self.in_flight is None:
            self.in_flight = set()
        self.in_flight.add(task)
        task.add_done_callback(self._done)

    def full(self) -> bool:
        return self.in_flight is not None and len(self.in_flight) >= MAX_IN_FLIGHT

    def _done(self, task: asyncio.Task[None]) -> None:
        if self.in_flight is not None:
            self.in_flight.discard(task)
            if not self.in_flight:
                self.in_flight = None
        backlog = self.backlog
        if backlog is not None:
            while backlog and not self.full():
                self.server._start(self, backlog.popleft())
            if not backlog:
                self.backlog = None
                self.ws.resume_reading()

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self.in_flight) if self.in_flight else []

    # -- websocket.Listener ------------------------------------------------------------------
    def message(self, data: bytes | str) -> None:
        if self.conn is None:  # (refused: only its close frame is read)
            return
        if self.backlog is None and not self.full():
            self.server._start(self, data)
            return
        if self.backlog is None:
            self.backlog = deque()
            self.ws.pause_reading()
        self.backlog.append(data)

    def seen(self) -> None:
        self.last_seen = time.monotonic()

    def failed(self, failure: websocket.Failure) -> None:
        self.server._note_error(self, failure.reason, failure.code == websocket.TOO_BIG)

    def ended(self) -> None:
        self.server._ended(self)


class CollectorServer:
    def __init__(
        self,
        collector: Collector,
        host: str,
        port: int,
        grpc_port: int | None,
        echo: Callable[[str], None] = lambda _: None,
        sock: socket.socket | None = None,
        grpc_handle: Handle | None = None,
    ) -> None:
        self.collector = collector
        # what serves a gRPC call (an intake worker's shares them: collector.sharing)
        self.grpc_handle = grpc_handle or collector.raccoon_grpc
        self.sock = sock  # a listening socket made for this server (an intake worker's)
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self._echo = echo
        self._sockets: set[_Socket] = set()
        self._background: set[asyncio.Task[None]] = set()  # admissions and releases of sockets
        self._runner: web.AppRunner | None = None
        self._grpc: GrpcServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._statsd: StatsdExporter | None = None
        self._listener: asyncio.Server | None = None
        self.certificate: ServerCertificate | None = None  # collector.tls, once started
        self._deadline = HeadDeadline(
            collector.config.limits.request_timeout_s,
            lambda: collector.metrics.rejected("request_timeout"),
        )

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        limits = self.collector.config.limits
        loop = asyncio.get_running_loop()
        self.certificate = server_certificate(self.collector.config.tls, "collector.tls")
        tls = self.certificate.context(HTTP1) if self.certificate is not None else None
        handshake_s = limits.request_timeout_s if tls is not None else None  # timed as a head

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
        protocol = self._deadline.factory(server, self._upgrade)
        if self.sock is not None:
            self._listener = await loop.create_server(
                protocol, sock=self.sock, ssl=tls, ssl_handshake_timeout=handshake_s
            )
        else:
            self._listener = await loop.create_server(
                protocol,
                self.host,
                self.port,
                reuse_address=True,
                ssl=tls,
                ssl_handshake_timeout=handshake_s,
            )
        if self._listener.sockets:
            self.port = self._listener.sockets[0].getsockname()[1]
        if self.grpc_port is not None:
            self._grpc = GrpcServer(
                self.grpc_handle,
                self.host,
                self.grpc_port,
                limits.max_body_bytes,
                share_port=self.sock is not None,
                request_timeout_s=limits.request_timeout_s,
                tls=self.certificate.context(H2) if self.certificate is not None else None,
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
        await asyncio.gather(
            *(
                s.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
                for s in list(self._sockets)
            ),
            return_exceptions=True,
        )
        if self._background:  # connections being admitted or released
            await asyncio.wait(list(self._background), timeout=grace)
        if self._listener is not None:
            self._listener.close()  # stop accepting; open connections are the runner's to end
        if self._runner is not None:
            await self._runner.cleanup()  # stops listening, waits for in-flight HTTP requests
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await collector.publisher.finish()  # what was appended reaches the log
        if self._statsd is not None:
            self._statsd.flush((collector.config.statsd.host, collector.config.statsd.port))  # type: ignore[union-attr]
            self._statsd.close()
        collector.ready = False

    def reload_tls(self) -> bool:
        """Present the certificate files anew on both ports' new connections (SIGHUP); False
        when there is no TLS or the files do not load (logged; the old certificate stays)."""
        return self.certificate is not None and self.certificate.reload()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.collector.config.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

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
            if not request.can_read_body:
                body = b""
            elif request.content.is_eof():  # all of it came with the head: nothing to wait for
                body = await request.read()
            else:
                async with asyncio.timeout(self._deadline.timeout_s):
                    body = await request.read()
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
    def _upgrade(self, head: bytes, transport: asyncio.Transport) -> bool | None:
        """A connection's first bytes: take it if they are a WebSocket upgrade to ``WS_PATH``
        (``HeadDeadline``'s hook)."""
        upgrade = websocket.take_upgrade(head, WS_PATH)
        if not isinstance(upgrade, websocket.Upgrade):
            return upgrade
        self._take(upgrade, transport)
        return True

    def _take(self, upgrade: websocket.Upgrade, transport: asyncio.Transport) -> None:
        """Serve the connection as a WebSocket (``transport``'s protocol from now on), once it
        is admitted."""
        sock = _Socket(self, None)
        frames = websocket.Frames(self.collector.config.limits.max_frame_bytes, upgrade.extensions)
        ws = sock.ws = websocket.WebSocket(frames, sock)
        transport.set_protocol(ws)
        ws.connection_made(transport)
        ws.pause_reading()  # until the connection is admitted
        self._in_background(self._admit(sock, upgrade, transport))

    def _in_background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _admit(
        self, sock: _Socket, upgrade: websocket.Upgrade, transport: asyncio.Transport
    ) -> None:
        peer = transport.get_extra_info("peername")
        remote = peer[0] if isinstance(peer, tuple) else ""
        ws: websocket.WebSocket = sock.ws
        if self.collector.draining:
            transport.write(SHUTTING_DOWN)
            transport.close()
            return
        try:
            conn = await self.collector.open_connection(upgrade.headers, remote)
        except Rejected as e:
            self.collector.metrics.rejected(e.kind)
            transport.write(upgrade.response)
            with contextlib.suppress(ConnectionError):
                await ws.send_bytes(raccoon.error_response_bytes(e))
            ws.resume_reading()  # for the client's close frame (new messages are not taken)
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=e.reason[:120].encode())
            return
        except Exception:  # (the log's process gone, say): the client is told to retry
            log.exception("could not admit a WebSocket connection")
            transport.write(NOT_ADMITTED)
            transport.close()
            return
        if ws.closed:  # the client left while it waited
            self.collector.close_connection(conn)
            return
        sock.conn = conn
        transport.write(upgrade.response)
        self._sockets.add(sock)
        if upgrade.rest:
            ws.data_received(upgrade.rest)
        ws.resume_reading()

    def _start(self, sock: _Socket, data: bytes | str) -> None:
        sock.add(asyncio.create_task(self._answer(sock, data)))

    def _ended(self, sock: _Socket) -> None:
        """One of the collector's own connections is gone: release it once its requests are
        answered (they are stored)."""
        self._sockets.discard(sock)
        sock.backlog = None
        if sock.conn is None:
            return
        if sock.in_flight:
            self._in_background(self._release(sock))
        else:
            self.collector.close_connection(sock.conn)

    async def _release(self, sock: _Socket) -> None:
        tasks = sock.tasks()
        if tasks:  # (they may have ended before this task ran)
            await asyncio.wait(tasks)
        assert sock.conn is not None
        self.collector.close_connection(sock.conn)

    async def _websocket(self, request: web.BaseRequest) -> web.StreamResponse:
        """An upgrade that reached aiohttp (a later request on a kept-alive connection, or a
        head too long for ``take_upgrade``): checked by the same handshake, then taken from
        aiohttp's handler and served like a first-request upgrade."""
        answer = websocket.handshake(_request_head(request))
        handler = request.protocol
        transport = request.transport
        # aiohttp's parser stops at an upgrade's head and keeps what follows in _message_tail
        # (more of it as it arrives) until a WebSocket reader is set: the client's first frames.
        if not isinstance(answer, websocket.Upgrade):
            return _refusal(answer)
        if not handler._upgraded or transport is None:  # (its parser went on past the head)
            return _refusal(None)
        answer.rest = handler._message_tail
        handler._message_tail = b""
        # aiohttp lets go of the connection: with no transport its handler writes and closes
        # nothing, and connection_lost ends its keep-alive timer and its place in the server's
        # connections (so the runner's shutdown does not close a WebSocket).
        handler.transport = None
        handler.connection_lost(None)
        self._take(answer, transport)
        return _Detached()

    def _note_error(self, sock: _Socket, reason: str, too_large: bool) -> None:
        self.collector.metrics.rejected("too_large" if too_large else "ws_error")
        who = sock.conn.identity if sock.conn is not None else "a client"
        log.info("closing WebSocket of %s: %s", who, reason)

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
                        self._in_background(  # (it waits for the client's close frame)
                            sock.ws.close(
                                code=WSCloseCode.GOING_AWAY, message=b"no pong within the deadline"
                            )
                        )
                    else:
                        await sock.ws.ping()
                except ConnectionError:
                    continue
