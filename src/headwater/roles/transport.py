"""``headwater transport`` as a server role: the configured readers alone, on the configured bus,
with ``/healthz`` on ``--host``/``--port``. SIGTERM: each reader appends what it holds, records
its position and stops. On the embedded log ``headwater up`` runs the readers itself (see
``open_role_bus``).
"""

from __future__ import annotations

import asyncio
from functools import partial

from aiohttp import web

from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput
from headwater.roles.base import (
    Echo,
    health_site,
    listen_address,
    open_role_bus,
    role_running,
    until_stopped,
)


async def serve_transport(
    config: HeadwaterConfig,
    host: str | None,
    port: int | None,
    echo: Echo = print,
    stop: asyncio.Event | None = None,
) -> None:
    from headwater.transport.runner import Readers

    if not config.transport.readers:
        raise BadInput("transport.readers is empty: there is nothing to read")
    opening = partial(open_role_bus, config, "transport readers", "reader processes")
    async with role_running(stop, opening, echo) as run:
        readers = Readers(config, run.bus)

        async def healthz(_: web.Request) -> web.Response:
            failing = ", ".join(f"{k}: {v}" for k, v in readers.errors.items())
            return web.Response(text=f"ok (failing: {failing})" if failing else "ok")

        listen = listen_address(config.transport, host, port)
        async with health_site(config, listen, healthz, echo):
            task = asyncio.create_task(readers.run(run.stop), name="transport")
            names = ", ".join(readers.names)
            await until_stopped(
                run.stop, echo, f"headwater: transport ready (readers: {names}; stop with SIGTERM)"
            )
            await task
