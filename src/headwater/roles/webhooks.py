"""``headwater webhooks`` as a server role: the webhook workers alone, on the configured bus and
state, with ``/healthz`` on ``--host``/``--port``. Run several (with ``bus: kafka`` and
``webhooks.state.backend: redis``, or the SQLite state on one machine) and they share the work
and the receivers' rate limits. SIGTERM: stop reading, finish the steps in flight, commit. On the
embedded log ``headwater up`` runs the workers itself (see ``open_role_bus``).
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


async def serve_webhooks(
    config: HeadwaterConfig,
    host: str | None,
    port: int | None,
    echo: Echo = print,
    stop: asyncio.Event | None = None,
) -> None:
    from headwater.webhooks.state import open_state
    from headwater.webhooks.worker import Workers

    if not config.webhooks.receivers:
        raise BadInput("webhooks.receivers is empty: there is nothing for the workers to do")
    opening = partial(open_role_bus, config, "webhook workers", "worker processes")
    async with role_running(stop, opening, echo) as run:
        ready = False

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(status=200 if ready else 503, text="ok" if ready else "starting")

        store = run.store = await asyncio.to_thread(open_state, config)
        async with health_site(config, listen_address(config.webhooks, host, port), healthz, echo):
            workers = Workers(config.webhooks, run.bus, store)
            task = asyncio.create_task(workers.run(run.stop), name="webhooks")
            task.add_done_callback(lambda _: run.stop.set())
            await asyncio.to_thread(workers.create_topics)
            ready = True
            names = ", ".join(r.name for r in config.webhooks.receivers)
            await until_stopped(
                run.stop,
                echo,
                f"headwater: webhook workers ready (receivers: {names}; stop with SIGTERM)",
            )
            await task
