"""``headwater up``: open the bus and serve ``GET /healthz`` until SIGTERM or SIGINT.

The collector and the pipeline join this process in later work; for now it holds the log open
(so its write lock says the log is in use) and reports health. The HTTP responder is a few
lines over asyncio streams: enough for health checks, with no dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass

from headwater.bus import Bus, open_bus
from headwater.config.model import HeadwaterConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
HEALTH_PATH = "/healthz"
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_HEAD = 16 * 1024

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


@dataclass
class Health:
    """What ``/healthz`` reports: ``ok`` once the bus is open, ``starting`` or ``stopping``."""

    state: str = "starting"

    @property
    def ok(self) -> bool:
        return self.state == "ok"


class HealthServer:
    """A minimal HTTP/1.1 responder for ``GET /healthz`` (one request per connection)."""

    def __init__(self, health: Health, host: str, port: int) -> None:
        self.health = health
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=MAX_REQUEST_HEAD
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{HEALTH_PATH}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = b""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, body, extra = self._respond(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body, extra = 400, "bad request", {}
        except ConnectionError:
            writer.close()
            return
        method = head.split(b" ", 1)[0]
        payload = body.encode() + b"\n"
        lines = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(payload)}",
            "Cache-Control: no-store",
            "Connection: close",
            *(f"{k}: {v}" for k, v in extra.items()),
        ]
        response = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if method != b"HEAD":
            response += payload
        with contextlib.suppress(ConnectionError):
            writer.write(response)
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    def _respond(self, head: bytes) -> tuple[int, str, dict[str, str]]:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "bad request", {}
        method, target, _version = parts
        if target.split("?", 1)[0] != HEALTH_PATH:
            return 404, "not found", {}
        if method not in ("GET", "HEAD"):
            return 405, "method not allowed", {"Allow": "GET, HEAD"}
        if self.health.ok:
            return 200, "ok", {}
        return 503, self.health.state, {}


def describe_bus(config: HeadwaterConfig) -> str:
    """Where the configured log is, for people."""
    if config.bus.backend == "embedded":
        return f"embedded log at {config.log_dir()} (durability {config.bus.embedded.durability})"
    return f"Kafka at {config.bus.kafka.bootstrap_servers}"


async def serve(
    config: HeadwaterConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    echo: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve health and hold the bus open until ``stop`` is set (by SIGTERM/SIGINT when this
    runs in the main thread); then close the bus (flushing it and persisting offsets)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (RuntimeError, ValueError):  # not the main thread
            pass

    health = Health()
    server = HealthServer(health, host, port)
    bus: Bus | None = None
    try:
        await server.start()
        echo(f"headwater: health at {server.url}")
        config.data_dir.mkdir(parents=True, exist_ok=True)
        bus = await asyncio.to_thread(open_bus, config)
        health.state = "ok"
        echo(f"headwater: bus open: {describe_bus(config)}")
        echo("headwater: ready (stop with Ctrl-C or SIGTERM)")
        await stop.wait()
        echo("headwater: stopping")
        health.state = "stopping"
    finally:
        await server.stop()
        if bus is not None:
            await asyncio.to_thread(bus.close)
        for sig in installed:
            loop.remove_signal_handler(sig)
    echo("headwater: stopped")


def run_up(
    config: HeadwaterConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    echo: Callable[[str], None] = print,
) -> None:
    """Run ``serve`` to completion in a new event loop."""
    asyncio.run(serve(config, host, port, echo))
