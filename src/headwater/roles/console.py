"""``headwater console``: the operator console as a role of its own, reading the same data as the
CLI: the log (opened read-only when it is the embedded one), status files, the failed store, the
webhook state."""

from __future__ import annotations

import asyncio

from headwater.bus import Bus, open_bus
from headwater.collector.tls import server_certificate
from headwater.config.model import HeadwaterConfig
from headwater.console.app import Console
from headwater.console.site import console_site
from headwater.ops.errors import BadInput
from headwater.roles.base import (
    Echo,
    listen_address,
    on_hangup,
    remove_signals,
    role_running,
    until_stopped,
)


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
    echo: Echo = print,
    stop: asyncio.Event | None = None,
) -> None:
    """``headwater console`` until SIGTERM or ``stop`` (with ``console.tls``, SIGHUP reloads
    the certificate)."""
    require_tokens(config)
    certificate = server_certificate(config.console.tls, "console.tls")

    async def opening() -> Bus:
        if config.bus.backend == "embedded":
            config.log_dir().mkdir(parents=True, exist_ok=True)
        return await asyncio.to_thread(open_bus, config, read_only=True)

    async with role_running(stop, opening, echo) as run:
        if config.webhooks.sources or config.webhooks.receivers:
            from headwater.webhooks.state import open_state

            run.store = await asyncio.to_thread(open_state, config)
        console = Console(config, run.bus, webhook_state=run.store)
        listen = listen_address(config.console, host, port)
        hangup = on_hangup(certificate.reload) if certificate is not None else []
        try:
            async with console_site(console, *listen, certificate) as url:
                echo(f"headwater: console at {url}/ (health at {url}/healthz)")
                await until_stopped(run.stop, echo, "headwater: console ready (stop with SIGTERM)")
        finally:
            remove_signals(hangup)
