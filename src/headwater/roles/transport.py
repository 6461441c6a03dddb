"""``headwater transport`` as a server role: the configured readers alone, on the configured bus,
with ``/healthz`` on ``--host``/``--port``. SIGTERM: each reader appends what it holds, records
its position and stops.

On the embedded log the process that holds the log (``headwater up``) runs the readers itself;
a second process cannot write to it, so this role says so and exits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput
from headwater.roles.base import (
    close_role,
    describe_bus,
    health_site,
    open_role_bus,
    remove_signals,
    stop_on_signals,
)


async def serve_transport(
    config: HeadwaterConfig,
    host: str | None,
    port: int | None,
    echo: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    from headwater.transport.runner import Readers

    if not config.transport.readers:
        raise BadInput("transport.readers is empty: there is nothing to read")
    stop = stop or asyncio.Event()
    installed = stop_on_signals(stop)
    try:
        bus = await open_role_bus(config, "transport readers", "reader processes")
    except BaseException:
        remove_signals(installed)
        raise
    readers = Readers(config, bus)

    async def healthz(_: web.Request) -> web.Response:
        failing = ", ".join(f"{k}: {v}" for k, v in readers.errors.items())
        return web.Response(text=f"ok (failing: {failing})" if failing else "ok")

    listen = (host or config.transport.host, config.transport.port if port is None else port)
    try:
        async with health_site(*listen, healthz) as url:
            echo(f"headwater: bus open: {describe_bus(config)}")
            echo(f"headwater: health at {url}")
            task = asyncio.create_task(readers.run(stop), name="transport")
            names = ", ".join(readers.names)
            echo(f"headwater: transport ready (readers: {names}; stop with SIGTERM)")
            await stop.wait()
            echo("headwater: stopping")
            await task
    finally:
        await close_role(bus, installed, echo)


def run_transport(
    config: HeadwaterConfig, host: str | None, port: int | None, echo: Callable[[str], None]
) -> None:
    asyncio.run(serve_transport(config, host, port, echo))
