"""What the server roles that run beside ``headwater up`` share (``headwater webhooks``,
``headwater transport``): opening the bus with a clear refusal when ``up`` holds the embedded
log, and a small HTTP site for ``/healthz``."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from aiohttp import web

from headwater.bus import Bus, open_bus
from headwater.bus.errors import LogLocked
from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput

if TYPE_CHECKING:
    from headwater.webhooks.state import StateStore


async def open_role_bus(config: HeadwaterConfig, runs: str, processes: str) -> Bus:
    """The configured bus. On the embedded log held by ``headwater up`` (which ``runs`` the
    role itself), a clear error: separate ``processes`` need Kafka."""
    if config.bus.backend == "embedded":
        config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        return await asyncio.to_thread(open_bus, config)
    except LogLocked:
        raise BadInput(
            f"the embedded log at {config.log_dir()} is held by another process: `headwater up` "
            f"runs the {runs} itself; separate {processes} need bus: kafka"
        ) from None


@asynccontextmanager
async def health_site(
    host: str, port: int, healthz: Callable[[web.Request], Awaitable[web.Response]]
) -> AsyncIterator[str]:
    """Serve ``GET /healthz`` on ``host:port`` (0: any free port); yields its URL."""
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        yield f"http://{bound[0]}:{bound[1]}/healthz"
    finally:
        await runner.cleanup()


async def close_role(
    bus: Bus,
    installed: list[signal.Signals],
    echo: Callable[[str], None],
    store: StateStore | None = None,
) -> None:
    """A role's last steps: its webhook state closed, its bus flushed and closed, its signal
    handlers removed, and ``stopped`` said."""
    if store is not None:
        store.close()
    await asyncio.to_thread(bus.close)
    remove_signals(installed)
    echo("headwater: stopped")


def describe_bus(config: HeadwaterConfig) -> str:
    """Where the configured log is, for people."""
    if config.bus.backend == "embedded":
        return f"embedded log at {config.log_dir()} (durability {config.bus.embedded.durability})"
    return f"Kafka at {config.bus.kafka.bootstrap_servers}"


def stop_on_signals(stop: asyncio.Event) -> list[signal.Signals]:
    """Make SIGTERM and SIGINT set ``stop`` (in the main thread only); the ones installed."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (RuntimeError, ValueError):  # not the main thread
            pass
    return installed


def remove_signals(installed: list[signal.Signals]) -> None:
    loop = asyncio.get_running_loop()
    for sig in installed:
        loop.remove_signal_handler(sig)
