"""Serving the console: beside the rest in ``headwater up`` (``console_site``), or as its own
role, ``headwater console`` (``serve_console``), which reads the same data as the CLI: the log
(opened read-only when it is the embedded one), status files, the failed store, the webhook
state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from aiohttp import web

from headwater.bus import open_bus
from headwater.config.model import HeadwaterConfig
from headwater.ops.console.app import Console, make_app
from headwater.ops.console.sampler import run_sampler
from headwater.ops.errors import BadInput
from headwater.ops.role import close_role
from headwater.ops.up import remove_signals, stop_on_signals


def require_tokens(config: HeadwaterConfig) -> None:
    if not config.console.admin_token_hashes:
        raise BadInput(
            "console.admin_token_hashes is empty: nobody could log in. Make a token's hash with "
            "`headwater hash-key <token>` and list it under console.admin_token_hashes"
        )


@asynccontextmanager
async def console_site(console: Console, host: str, port: int) -> AsyncIterator[str]:
    """Serve the console on ``host:port`` (0: any free port) and keep its charts' points;
    yields its URL."""
    runner = web.AppRunner(make_app(console), access_log=None, handle_signals=False)
    stop = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        sampler = asyncio.create_task(run_sampler(console, stop), name="console-sampler")
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        stop.set()
        console.closing.set()
        if sampler is not None:
            with suppress(asyncio.CancelledError):
                await sampler
        await runner.cleanup()


async def serve_console(
    config: HeadwaterConfig,
    host: str | None,
    port: int | None,
    echo: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    """``headwater console`` until SIGTERM or ``stop``."""
    require_tokens(config)
    stop = stop or asyncio.Event()
    installed = stop_on_signals(stop)
    store = None
    try:
        if config.bus.backend == "embedded":
            config.log_dir().mkdir(parents=True, exist_ok=True)
        bus = await asyncio.to_thread(open_bus, config, read_only=True)
    except BaseException:
        remove_signals(installed)
        raise
    try:
        if config.webhooks.sources or config.webhooks.receivers:
            from headwater.webhooks.state import open_state

            store = await asyncio.to_thread(open_state, config)
        console = Console(config, bus, webhook_state=store)
        listen = (host or config.console.host, config.console.port if port is None else port)
        async with console_site(console, *listen) as url:
            echo(f"headwater: console at {url}/ (health at {url}/healthz)")
            echo("headwater: console ready (stop with SIGTERM)")
            await stop.wait()
            echo("headwater: stopping")
    finally:
        await close_role(bus, installed, echo, store)


def run_console(
    config: HeadwaterConfig, host: str | None, port: int | None, echo: Callable[[str], None]
) -> None:
    asyncio.run(serve_console(config, host, port, echo))
