"""``headwater console``: the operator console as a role of its own, reading the same data as the
CLI: the log (opened read-only when it is the embedded one), status files, the failed store, the
webhook state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from headwater.bus import open_bus
from headwater.config.model import HeadwaterConfig
from headwater.console.app import Console
from headwater.console.site import console_site
from headwater.ops.errors import BadInput
from headwater.roles.base import close_role, remove_signals, stop_on_signals


def require_tokens(config: HeadwaterConfig) -> None:
    if not config.console.admin_token_hashes:
        raise BadInput(
            "console.admin_token_hashes is empty: nobody could log in. Make a token's hash with "
            "`headwater hash-key <token>` and list it under console.admin_token_hashes"
        )


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
