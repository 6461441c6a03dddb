"""The console's pages (GET): overview, live events, destinations, failed events, webhooks,
transport, configuration. Each reads in a thread and renders one template."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from typing import Any

import yaml
from aiohttp import web

from headwater.bus.errors import InvalidArgument
from headwater.console import data
from headwater.console.app import CONSOLE_KEY, Console
from headwater.console.charts import line_chart
from headwater.ops.masking import masked
from headwater.pipeline.failed import iso_at

HOUR_S = 3600.0


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", overview)
    app.router.add_get("/live", live_page)
    app.router.add_get("/destinations", destinations)
    app.router.add_get("/destinations/{id}", destination)
    app.router.add_get("/failed", failed)
    app.router.add_get("/failed/event", failed_event)
    app.router.add_get("/webhooks", webhooks)
    app.router.add_get("/webhooks/message", webhook_message)
    app.router.add_get("/transport", transport)
    app.router.add_get("/config", configuration)


def _console(request: web.Request) -> Console:
    return request.app[CONSOLE_KEY]


def when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def parse_since(value: str) -> str | None:
    """An ISO 8601 time from a form, as the failed store compares it (UTC, Z); raises 400."""
    if not value:
        return None
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"since: {value!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return iso_at(moment.timestamp())


async def overview(request: web.Request) -> web.Response:
    console = _console(request)

    def read() -> dict[str, Any]:
        return {
            "failed_last_hour": console.failed.count(iso_at(time.time() - HOUR_S)),
            "topics": data.log_topics(console.config, console.bus),
            "lags": data.writer_lags(console.config, console.bus),
            "readers": data.transport_statuses(console.config),
            "statuses": data.destination_statuses(console.config, _running(console)),
        }

    found = await console.run(read)
    s = console.series
    now = time.time()
    recent = [
        st
        for st in found["statuses"].values()
        if st.last_error_at is not None and st.last_error_at > now - HOUR_S
    ]
    charts = [
        line_chart(
            "Intake by protocol",
            {n.split(":", 1)[1]: s.rates(n) for n in s.names("protocol:")},
            "/s",
        ),
        line_chart(
            "Intake by source", {n.split(":", 1)[1]: s.rates(n) for n in s.names("source:")}, "/s"
        ),
        line_chart(
            "Appended to the log", {n.split(":", 1)[1]: s.rates(n) for n in s.names("topic:")}, "/s"
        ),
        line_chart("Writers' lag", {n.split(":", 1)[1]: s.points(n) for n in s.names("lag:")}),
        line_chart("Failed events", {"failed store": s.rates("failed")}, "/s"),
    ]
    return console.render(
        request,
        "overview.html",
        charts=charts,
        webhooks_failed_last_hour=await console.run(_webhooks_failed, console, now - HOUR_S),
        destination_errors=recent,
        when=when,
        **found,
    )


def _webhooks_failed(console: Console, since: float) -> int | None:
    store = console.webhook_state
    return None if store is None else len(store.failed(None, since, data.COUNT_CAP))


def _running(console: Console) -> list[Any] | None:
    return console.pipeline.status.all() if console.pipeline is not None else None


async def live_page(request: web.Request) -> web.Response:
    console = _console(request)
    topics = await console.run(console.bus.topics)
    return console.render(request, "live.html", topics=[t.name for t in topics])


async def destinations(request: web.Request) -> web.Response:
    console = _console(request)
    from headwater.pipeline.status import paused

    def read() -> tuple[dict[str, Any], dict[str, Any]]:
        return (
            data.destination_statuses(console.config, _running(console)),
            paused(console.config),
        )

    statuses, held = await console.run(read)
    return console.render(
        request,
        "destinations.html",
        destinations=console.config.pipeline.destinations,
        statuses=statuses,
        paused=held,
        when=when,
        done=request.query.get("done", ""),
    )


async def destination(request: web.Request) -> web.Response:
    console = _console(request)
    from headwater.pipeline.status import paused

    wanted = request.match_info["id"]
    dest = next((d for d in console.config.pipeline.destinations if d.id == wanted), None)
    if dest is None:
        raise web.HTTPNotFound(text=f"no destination named {wanted!r}")

    def read() -> tuple[Any, ...]:
        tables, problem = data.table_columns(console.config, dest, console.pipeline is not None)
        statuses = data.destination_statuses(console.config, _running(console))
        return tables, problem, statuses.get(dest.id), paused(console.config)

    tables, problem, status, held = await console.run(read)
    return console.render(
        request,
        "destination.html",
        dest=dest,
        tables=tables,
        problem=problem,
        status=status,
        paused=held,
        when=when,
    )


def _filters(request: web.Request, names: tuple[str, ...]) -> dict[str, str]:
    return {n: request.query.get(n, "").strip() for n in names}


async def failed(request: web.Request) -> web.Response:
    console = _console(request)
    chosen = _filters(request, ("destination", "step", "code", "contract", "since"))
    since = parse_since(chosen["since"])
    before = request.query.get("before") or None

    def read() -> tuple[Any, int]:
        found = console.failed.page(
            destination=chosen["destination"] or None,
            step=chosen["step"] or None,
            code=chosen["code"] or None,
            contract=chosen["contract"] or None,
            since=since,
            before=before,
            limit=console.config.console.page_size,
        )
        return found, console.failed.count()

    try:
        page, total = await console.run(read)
    except InvalidArgument as e:
        raise web.HTTPBadRequest(text=str(e)) from None
    return console.render(
        request,
        "failed.html",
        page=page,
        total=total,
        filters=chosen,
        destinations=[d.id for d in console.config.pipeline.destinations],
        done=request.query.get("done", ""),
    )


async def failed_event(request: web.Request) -> web.Response:
    console = _console(request)
    event_id = request.query.get("id", "")
    event = await console.run(console.failed.get, event_id)
    if event is None:
        raise web.HTTPNotFound(text=f"no failed event with id {event_id!r}")
    return console.render(
        request,
        "failed_event.html",
        event=event,
        shown=event.to_json(),
        decoded=_decoded(event.value),
        violations=_violations(event.step, event.reason),
    )


def _violations(step: str, reason: str) -> list[str]:
    """A broken contract's violations, one per line (path: message (keyword))."""
    if step != "contract" or ": " not in reason:
        return []
    return re.split(r"; (?=/)", reason.split(": ", 1)[1])  # each starts with its JSON path


def _decoded(value: bytes) -> str | None:
    """The value as indented JSON when it is JSON (None: it is not)."""
    try:
        return json.dumps(json.loads(value), indent=2, ensure_ascii=False)
    except (ValueError, UnicodeDecodeError):
        return None


async def webhooks(request: web.Request) -> web.Response:
    console = _console(request)
    from headwater.webhooks.state.base import Status

    chosen = _filters(request, ("source", "status", "receiver"))
    if chosen["status"] and chosen["status"] not in Status.__members__:
        raise web.HTTPBadRequest(text=f"status: {chosen['status']!r} is not one of {list(Status)}")
    before = _cursor(request.query.get("before", ""))
    store = console.webhook_state
    if store is None:
        return console.render(request, "webhooks.html", configured=False, done="")

    def read() -> tuple[Any, ...]:
        rows = store.messages(
            chosen["source"] or None,
            chosen["status"] or None,
            chosen["receiver"] or None,
            console.config.console.page_size + 1,
            before,
        )
        return rows, store.counts(), store.receivers()

    rows, counts, flags = await console.run(read)
    size = console.config.console.page_size
    following = None
    if len(rows) > size:
        rows = rows[:size]
        last = rows[-1]
        following = f"{last.updated_at!r}|{last.source_id}|{last.message_id}"
    return console.render(
        request,
        "webhooks.html",
        configured=True,
        rows=rows,
        following=following,
        counts=counts,
        flags=flags,
        receivers=console.config.webhooks.receivers,
        statuses=[s.value for s in Status],
        filters=chosen,
        when=when,
        done=request.query.get("done", ""),
    )


def _cursor(value: str) -> tuple[float, str, str] | None:
    if not value:
        return None
    at, _, rest = value.partition("|")
    source, _, message = rest.partition("|")
    try:
        return (float(at), source, message)
    except ValueError:
        raise web.HTTPBadRequest(text=f"before: {value!r} is not a page cursor") from None


async def webhook_message(request: web.Request) -> web.Response:
    console = _console(request)
    store = console.webhook_state
    source, message = request.query.get("source", ""), request.query.get("id", "")
    state = None if store is None else await console.run(store.get, source, message)
    if state is None:
        raise web.HTTPNotFound(text=f"no webhook message {message!r} from source {source!r}")
    return console.render(
        request,
        "webhook_message.html",
        state=state,
        payload=_decoded(state.payload) or state.payload.decode("utf-8", "replace"),
        when=when,
        done=request.query.get("done", ""),
    )


async def transport(request: web.Request) -> web.Response:
    console = _console(request)
    readers = await console.run(data.transport_statuses, console.config)
    return console.render(request, "transport.html", readers=readers)


async def configuration(request: web.Request) -> web.Response:
    console = _console(request)
    text = yaml.safe_dump(masked(console.config), sort_keys=False, allow_unicode=True)
    return console.render(request, "config.html", text=text)
