"""The console's web site: its routes (``make_app``) and the site serving them with the sampler
that keeps its charts' points (``console_site``), beside the rest in ``headwater up`` or as the
``headwater console`` role (``headwater.roles.console``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from aiohttp import web

from headwater.collector.tls import HTTP1, ServerCertificate
from headwater.console import actions, live, pages
from headwater.console.app import (
    CONSOLE_KEY,
    HERE,
    Console,
    guard,
    healthz,
    login,
    login_page,
    logout,
)
from headwater.console.sampler import run_sampler


@asynccontextmanager
async def console_site(
    console: Console, host: str, port: int, certificate: ServerCertificate | None = None
) -> AsyncIterator[str]:
    """Serve the console on ``host:port`` (0: any free port; over HTTPS with ``certificate``)
    and keep its charts' points; yields its URL."""
    runner = web.AppRunner(make_app(console), access_log=None, handle_signals=False)
    stop = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    try:
        await runner.setup()
        tls = certificate.context(HTTP1) if certificate is not None else None
        site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=tls)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        sampler = asyncio.create_task(run_sampler(console, stop), name="console-sampler")
        yield f"{'https' if tls is not None else 'http'}://{bound[0]}:{bound[1]}"
    finally:
        stop.set()
        console.closing.set()
        if sampler is not None:
            with suppress(asyncio.CancelledError):
                await sampler
        await runner.cleanup()


def make_app(console: Console) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=1 << 20)
    app[CONSOLE_KEY] = console
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_static("/static/", HERE / "static")
    pages.add_routes(app)
    actions.add_routes(app)
    live.add_routes(app)
    return app
