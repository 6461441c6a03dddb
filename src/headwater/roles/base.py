"""What the server roles that run beside ``headwater up`` share (``headwater webhooks``,
``headwater transport``, ``headwater console``): their start-up and shut-down (signals, the bus,
the webhook state), opening the bus with a clear refusal when ``up`` holds the embedded log, and
a small HTTP site for ``/healthz``."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from headwater.bus import Bus, open_bus
from headwater.bus.errors import LogLocked
from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput

if TYPE_CHECKING:
    from headwater.webhooks.state import StateStore


Echo = Callable[[str], None]
Serve = Callable[[HeadwaterConfig, str | None, int | None, Echo], Coroutine[Any, Any, None]]


class Listens(Protocol):
    """A role's config section: where it listens by default."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


def run_role(
    serve: Serve, config: HeadwaterConfig, host: str | None, port: int | None, echo: Echo
) -> None:
    """Run a role's ``serve`` (``serve_console``, ``serve_webhooks``...) until it stops, its
    GC paced (``collector.memory.paced``)."""
    from headwater.collector.memory import paced

    asyncio.run(paced(serve(config, host, port, echo)))


def listen_address(section: Listens, host: str | None, port: int | None) -> tuple[str, int]:
    """Where a role listens: ``--host``/``--port`` where given, else its section's."""
    return (host or section.host, section.port if port is None else port)


@dataclass
class RoleRun:
    """What a running role holds: the event that stops it, its bus, and its webhook state once
    opened."""

    stop: asyncio.Event
    bus: Bus
    store: StateStore | None = None


@asynccontextmanager
async def role_running(
    stop: asyncio.Event | None, open_: Callable[[], Awaitable[Bus]], echo: Echo
) -> AsyncIterator[RoleRun]:
    """A role's start-up and shut-down: SIGTERM and SIGINT set ``stop`` (a new event if None),
    and the bus ``open_`` gives is opened (the handlers removed again when that fails); on the
    way out, ``close_role`` (with the state the role put in ``store``)."""
    stop = stop or asyncio.Event()
    installed = stop_on_signals(stop)
    try:
        bus = await open_()
    except BaseException:
        remove_signals(installed)
        raise
    run = RoleRun(stop, bus)
    try:
        yield run
    finally:
        await close_role(bus, installed, echo, run.store)


async def until_stopped(stop: asyncio.Event, echo: Echo, ready: str) -> None:
    """Say the role is ``ready``, wait for ``stop``, and say it is stopping."""
    echo(ready)
    await stop.wait()
    echo("headwater: stopping")


async def open_role_bus(config: HeadwaterConfig, runs: str, processes: str) -> Bus:
    """The configured bus. On the embedded log, the process that holds it (``headwater up``)
    ``runs`` the role itself, and a second process cannot write to it: a clear error that
    separate ``processes`` need Kafka."""
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
    config: HeadwaterConfig,
    listen: tuple[str, int],
    healthz: Callable[[web.Request], Awaitable[web.Response]],
    echo: Echo,
) -> AsyncIterator[None]:
    """Serve ``GET /healthz`` on ``listen`` (port 0: any free port), and say where, and where the
    role's bus is."""
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    try:
        await runner.setup()
        site = web.TCPSite(runner, *listen, reuse_address=True)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        echo(f"headwater: bus open: {describe_bus(config)}")
        echo(f"headwater: health at http://{bound[0]}:{bound[1]}/healthz")
        yield
    finally:
        await runner.cleanup()


async def close_role(
    bus: Bus,
    installed: list[signal.Signals],
    echo: Echo,
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


def on_hangup(reload: Callable[[], object]) -> list[signal.Signals]:
    """Make SIGHUP call ``reload`` (in the main thread only); the signals installed."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (RuntimeError, ValueError):  # not the main thread
        return []
    return [signal.SIGHUP]


def remove_signals(installed: list[signal.Signals]) -> None:
    loop = asyncio.get_running_loop()
    for sig in installed:
        loop.remove_signal_handler(sig)
