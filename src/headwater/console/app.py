"""The console's web application: its state (``Console``), the guard every request passes,
login and logout, and the routes of the pages (``pages``), the actions (``actions``) and the
live tail (``live``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import jinja2
from aiohttp import web

from headwater.bus import Bus
from headwater.config.model import HeadwaterConfig
from headwater.console.auth import COOKIE, Session, Sessions, is_open, same_origin
from headwater.console.series import Series
from headwater.pipeline.failed import FailedStore
from headwater.pipeline.failed_index import FailedIndex

if TYPE_CHECKING:
    from headwater.collector.metrics import Metrics
    from headwater.pipeline.runner import Pipeline
    from headwater.webhooks.state import StateStore

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
CONSOLE_KEY: web.AppKey[Console] = web.AppKey("console")
SESSION_KEY: web.RequestKey[Session] = web.RequestKey("session")


@dataclass
class Console:
    """What the pages read and act on. Under ``headwater up`` the bus, the collector's
    metrics, the running pipeline and the webhook state are the process's own; under
    ``headwater console`` the bus is opened read-only and the rest is read where the CLI reads
    it (status files, the failed store, the webhook state)."""

    config: HeadwaterConfig
    bus: Bus
    metrics: Metrics | None = None
    pipeline: Pipeline | None = None
    webhook_state: StateStore | None = None
    series: Series = field(default_factory=Series)
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # ends the live tails
    sessions: Sessions = field(init=False)
    failed: FailedIndex = field(init=False)
    templates: jinja2.Environment = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config.console
        self.sessions = Sessions(list(cfg.admin_token_hashes), cfg.session_ttl_s)
        self.failed = FailedIndex(FailedStore(self.config))
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )

    def render(self, request: web.Request, name: str, **context: Any) -> web.Response:
        session = request.get(SESSION_KEY)
        page = self.templates.get_template(name).render(
            csrf=self.sessions.csrf(session) if session else "",
            path=request.path,
            logged_in=session is not None,
            **context,
        )
        return web.Response(text=page, content_type="text/html")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking read (the log, a database, a file) off the event loop."""
        return await asyncio.to_thread(fn, *args)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every path but the login page, /healthz and the static files needs a session; every
    POST the console's own origin, and (but the login) the session's CSRF token."""
    console = request.app[CONSOLE_KEY]
    if request.method == "POST" and not same_origin(request):
        raise web.HTTPForbidden(
            text="refused: a POST to the console must come from its own pages "
            "(the Origin or Referer header does not name this site)"
        )
    if not is_open(request.path):
        session = console.sessions.check(request.cookies.get(COOKIE))
        if session is None:
            if request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
                raise web.HTTPSeeOther(f"/login?next={quote(request.path_qs)}")
            raise web.HTTPUnauthorized(
                text="log in first: the console needs an admin token (POST /login)"
            )
        request[SESSION_KEY] = session
        if request.method == "POST":
            form = await request.post()
            if not console.sessions.csrf_ok(session, str(form.get("csrf", ""))):
                raise web.HTTPForbidden(text="refused: the form's CSRF token is missing or wrong")
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response


async def login_page(request: web.Request) -> web.Response:
    console = request.app[CONSOLE_KEY]
    return console.render(request, "login.html", next=_next(request), error=None)


async def login(request: web.Request) -> web.Response:
    console = request.app[CONSOLE_KEY]
    form = await request.post()
    next_path = _next(request, str(form.get("next", "/")))
    if console.sessions.throttled():
        response = console.render(
            request, "login.html", next=next_path, error="too many wrong tokens: wait a minute"
        )
        response.set_status(429)
        return response
    cookie = console.sessions.login(str(form.get("token", "")))
    if cookie is None:
        log.warning("console: a login with a wrong token from %s", request.remote)
        response = console.render(
            request, "login.html", next=next_path, error="that is not an admin token"
        )
        response.set_status(401)
        return response
    response = web.HTTPSeeOther(next_path)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(console.sessions.ttl_s),
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        path="/",
    )
    raise response


async def logout(request: web.Request) -> web.Response:
    response = web.HTTPSeeOther("/login")
    response.del_cookie(COOKIE, path="/")
    raise response


def _next(request: web.Request, value: str | None = None) -> str:
    """Where to go after logging in."""
    return local_path(value if value is not None else request.query.get("next", "/"))


def local_path(target: str, default: str = "/") -> str:
    """``target`` when it is a path of this site, else ``default`` (no open redirect)."""
    parts = urlsplit(target)
    if (
        parts.scheme
        or parts.netloc
        or not target.startswith("/")
        or target.startswith(("//", "/\\"))
    ):
        return default
    return target


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")
