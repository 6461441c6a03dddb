"""The console's actions (POST, with the session's CSRF token, from its own pages): pause and
resume a destination, replay failed events, resend webhook messages, disable and enable a
receiver. Each does what its CLI command does, then sends the browser back with what was done."""

from __future__ import annotations

import time
from urllib.parse import urlencode

from aiohttp import web

from headwater.console.app import CONSOLE_KEY, Console, local_path
from headwater.console.pages import parse_since
from headwater.errors import HeadwaterError


def add_routes(app: web.Application) -> None:
    app.router.add_post("/destinations/pause", pause)
    app.router.add_post("/destinations/resume", resume)
    app.router.add_post("/failed/replay", replay)
    app.router.add_post("/webhooks/resend", resend)
    app.router.add_post("/webhooks/receivers", receiver)


def _back(path: str, done: str, **query: str) -> web.HTTPSeeOther:
    return web.HTTPSeeOther(f"{path}?{urlencode({**query, 'done': done})}")


def _console(request: web.Request) -> Console:
    return request.app[CONSOLE_KEY]


async def _destination(request: web.Request) -> str:
    form = await request.post()
    wanted = str(form.get("id", ""))
    known = [d.id for d in _console(request).config.pipeline.destinations]
    if wanted not in known:
        raise web.HTTPBadRequest(
            text=f"no destination named {wanted!r} (configured: {', '.join(known) or 'none'})"
        )
    return wanted


async def pause(request: web.Request) -> web.Response:
    from headwater.pipeline.status import pause as hold

    dest = await _destination(request)
    await _console(request).run(hold, _console(request).config, dest, "the console")
    raise _back("/destinations", f"{dest}: paused (its running batch finishes first)")


async def resume(request: web.Request) -> web.Response:
    from headwater.pipeline.status import resume as release

    dest = await _destination(request)
    await _console(request).run(release, _console(request).config, dest)
    raise _back("/destinations", f"{dest}: resumed")


async def replay(request: web.Request) -> web.Response:
    """The events chosen by id (one or a selection), or every one of a destination (or all)
    failed since a time: through ``FailedStore.replay``, as ``headwater failed replay``."""
    from headwater.pipeline.failed import FailedStore

    console = _console(request)
    form = await request.post()
    ids = [str(v) for v in form.getall("id", []) if str(v)]
    destination = str(form.get("destination", "")) or None
    since = parse_since(str(form.get("since", "")))
    if not ids and form.get("all") != "yes":
        raise web.HTTPBadRequest(text="choose events to replay, or all (since a time)")
    known = {d.id for d in console.config.pipeline.destinations}
    if destination is not None and destination not in known:
        raise web.HTTPBadRequest(text=f"no destination named {destination!r}")

    def run() -> dict[str, int]:
        store = FailedStore(console.config)
        if ids:
            events = []
            for event_id in ids:
                event = console.failed.get(event_id)
                if event is None:
                    raise web.HTTPBadRequest(text=f"no failed event with id {event_id!r}")
                events.append(event)
        else:
            events = store.events(destination, since)
        return store.replay(events)

    counts = await console.run(run)
    said = ", ".join(f"{n} to {d}" for d, n in sorted(counts.items())) or "nothing"
    raise _back("/failed", f"replayed {said}")


async def resend(request: web.Request) -> web.Response:
    """Failed messages back to the stage they failed in, due now (``webhooks failed retry``)."""
    from headwater.webhooks.state import InvalidTransition, UnknownMessage

    console = _console(request)
    store = console.webhook_state
    if store is None:
        raise web.HTTPBadRequest(text="webhooks are not configured")
    form = await request.post()
    keys = [str(k) for k in form.getall("key", [])]
    if not keys:
        raise web.HTTPBadRequest(text="choose messages to resend (key = SOURCE_ID/MESSAGE_ID)")

    def run() -> list[str]:
        done = []
        for key in keys:
            source_id, sep, message_id = key.partition("/")
            if not sep:
                raise web.HTTPBadRequest(text=f"{key!r} is not SOURCE_ID/MESSAGE_ID")
            try:
                store.retry(source_id, message_id, time.time())
            except UnknownMessage:
                raise web.HTTPBadRequest(text=f"no webhook message {key!r}") from None
            except InvalidTransition as e:
                raise web.HTTPConflict(
                    text=f"{key} is {e.current}: only a FAILED message is resent"
                ) from None
            done.append(key)
        return done

    done = await console.run(run)
    back = local_path(str(form.get("back", "/webhooks")), "/webhooks")
    said = urlencode({"done": f"resent {len(done)} message(s)"})
    raise web.HTTPSeeOther(f"{back}{'&' if '?' in back else '?'}{said}")


async def receiver(request: web.Request) -> web.Response:
    console = _console(request)
    store = console.webhook_state
    form = await request.post()
    name = str(form.get("name", ""))
    action = str(form.get("action", ""))
    if store is None or console.config.webhooks.receiver(name) is None:
        raise web.HTTPBadRequest(text=f"no receiver named {name!r}")
    if action not in ("disable", "enable"):
        raise web.HTTPBadRequest(text="action must be disable or enable")
    disabled = action == "disable"
    reason = "disabled from the console" if disabled else ""
    try:
        await console.run(store.set_receiver, name, disabled, reason, time.time())
    except HeadwaterError as e:
        raise web.HTTPServiceUnavailable(text=str(e)) from None
    raise _back("/webhooks", f"{name}: {action}d")
