"""``headwater webhooks`` as a server role: the webhook workers alone, on the configured bus and
state, with ``/healthz`` on ``--host``/``--port``. Run several (with ``bus: kafka`` and
``webhooks.state.backend: redis``, or the SQLite state on one machine) and they share the work
and the receivers' rate limits. SIGTERM: stop reading, finish the steps in flight, commit.

On the embedded log the process that holds the log (``headwater up``) runs the workers itself;
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


async def serve_webhooks(
    config: HeadwaterConfig,
    host: str | None,
    port: int | None,
    echo: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    from headwater.webhooks.state import open_state
    from headwater.webhooks.worker import Workers

    if not config.webhooks.receivers:
        raise BadInput("webhooks.receivers is empty: there is nothing for the workers to do")
    stop = stop or asyncio.Event()
    installed = stop_on_signals(stop)
    try:
        bus = await open_role_bus(config, "webhook workers", "worker processes")
    except BaseException:
        remove_signals(installed)
        raise
    ready = False

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(status=200 if ready else 503, text="ok" if ready else "starting")

    store = None
    listen = (host or config.webhooks.host, config.webhooks.port if port is None else port)
    try:
        store = await asyncio.to_thread(open_state, config)
        async with health_site(*listen, healthz) as url:
            echo(f"headwater: bus open: {describe_bus(config)}")
            echo(f"headwater: health at {url}")
            workers = Workers(config.webhooks, bus, store)
            task = asyncio.create_task(workers.run(stop), name="webhooks")
            task.add_done_callback(lambda _: stop.set())
            await asyncio.to_thread(workers.create_topics)
            ready = True
            names = ", ".join(r.name for r in config.webhooks.receivers)
            echo(f"headwater: webhook workers ready (receivers: {names}; stop with SIGTERM)")
            await stop.wait()
            echo("headwater: stopping")
            await task
    finally:
        await close_role(bus, installed, echo, store)


def run_webhooks(
    config: HeadwaterConfig, host: str | None, port: int | None, echo: Callable[[str], None]
) -> None:
    asyncio.run(serve_webhooks(config, host, port, echo))
