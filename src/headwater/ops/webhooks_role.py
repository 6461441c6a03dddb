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

from headwater.bus import open_bus
from headwater.bus.errors import LogLocked
from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput
from headwater.ops.up import describe_bus, remove_signals, stop_on_signals


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
    if config.bus.backend == "embedded":
        config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        bus = await asyncio.to_thread(open_bus, config)
    except LogLocked:
        raise BadInput(
            f"the embedded log at {config.log_dir()} is held by another process: `headwater up` "
            "runs the webhook workers itself; separate worker processes need bus: kafka"
        ) from None
    ready = False

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(status=200 if ready else 503, text="ok" if ready else "starting")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    store = None
    try:
        store = await asyncio.to_thread(open_state, config)
        await runner.setup()
        site = web.TCPSite(
            runner,
            host or config.webhooks.host,
            config.webhooks.port if port is None else port,
            reuse_address=True,
        )
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        echo(f"headwater: bus open: {describe_bus(config)}")
        echo(f"headwater: health at http://{bound[0]}:{bound[1]}/healthz")
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
        await runner.cleanup()
        if store is not None:
            store.close()
        await asyncio.to_thread(bus.close)
        remove_signals(installed)
    echo("headwater: stopped")


def run_webhooks(
    config: HeadwaterConfig, host: str | None, port: int | None, echo: Callable[[str], None]
) -> None:
    asyncio.run(serve_webhooks(config, host, port, echo))
