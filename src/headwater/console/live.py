"""The live tail: records of a topic as they arrive, over server-sent events, filtered by event
type, source and a text match; one record whole (bytes, headers, decoded JSON) on demand.

The stream starts at the last few records of each partition and then follows the high
watermarks. At most ``MAX_PER_POLL`` records per poll go to a browser; more than that (a busy
topic) are counted as skipped, never queued, so a slow page cannot hold memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import web

from headwater.bus import Bus, Record
from headwater.bus import context as ctx
from headwater.bus.errors import UnknownPartition, UnknownTopic
from headwater.console.app import CONSOLE_KEY
from headwater.ops.records import record_to_json

POLL_S = 0.25
HEARTBEAT_S = 15.0
BACKLOG = 20
MAX_PER_POLL = 50
PREVIEW = 160


def add_routes(app: web.Application) -> None:
    app.router.add_get("/live/events", events)
    app.router.add_get("/live/record", record)


class Tail:
    """Where a browser's tail is on each partition of a topic, and its filters."""

    def __init__(self, bus: Bus, topic: str, kind: str, source: str, text: str) -> None:
        self.bus = bus
        self.topic = topic
        self.kind = kind
        self.source = source
        self.text = text.encode()
        self.next: dict[int, int] = {}
        for p in range(bus.topic(topic).partitions):
            low, high = bus.watermarks(topic, p)
            self.next[p] = max(low, high - BACKLOG)

    def poll(self) -> tuple[list[dict[str, Any]], int]:
        """New records that match (at most MAX_PER_POLL), and how many new ones were skipped."""
        shown: list[dict[str, Any]] = []
        skipped = 0
        for p, offset in self.next.items():
            _, high = self.bus.watermarks(self.topic, p)
            if high - offset > MAX_PER_POLL * 20:  # far behind: jump, say how many were passed
                skipped += high - MAX_PER_POLL - offset
                offset = high - MAX_PER_POLL
            while offset < high:
                batch = self.bus.read(self.topic, p, offset, max_records=500)
                if not batch:
                    break
                for r in batch:
                    if self.matches(r):
                        if len(shown) < MAX_PER_POLL:
                            shown.append(summary(r))
                        else:
                            skipped += 1
                offset = batch[-1].offset + 1
            self.next[p] = offset
        return shown, skipped

    def matches(self, r: Record) -> bool:
        headers = dict(r.headers)
        if self.kind and headers.get(ctx.TYPE, b"").decode("utf-8", "replace") != self.kind:
            return False
        if self.source and headers.get(ctx.SOURCE, b"").decode("utf-8", "replace") != self.source:
            return False
        if self.text:
            return self.text in r.value or any(self.text in v for v in headers.values())
        return True


def summary(r: Record) -> dict[str, Any]:
    headers = {k: v.decode("utf-8", "replace") for k, v in r.headers}
    return {
        "topic": r.topic,
        "partition": r.partition,
        "offset": r.offset,
        "timestamp": r.timestamp,
        "type": headers.get(ctx.TYPE, ""),
        "source": headers.get(ctx.SOURCE, ""),
        "protocol": headers.get(ctx.PROTOCOL, ""),
        "size": len(r.value),
        "preview": r.value[:PREVIEW].decode("utf-8", "replace"),
    }


async def events(request: web.Request) -> web.StreamResponse:
    console = request.app[CONSOLE_KEY]
    q = request.query
    topic = q.get("topic", "")
    try:
        tail = await console.run(
            Tail, console.bus, topic, q.get("type", ""), q.get("source", ""), q.get("q", "")
        )
    except UnknownTopic:
        raise web.HTTPNotFound(text=f"no topic named {topic!r}") from None
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
    )
    await response.prepare(request)
    last_write = time.monotonic()
    while not console.closing.is_set():
        if request.transport is None or request.transport.is_closing():
            break  # the browser went away
        shown, skipped = await console.run(tail.poll)
        chunks = [f"event: record\ndata: {json.dumps(s)}\n\n" for s in shown]
        if skipped:
            chunks.append(f"event: skipped\ndata: {skipped}\n\n")
        if not chunks and time.monotonic() - last_write > HEARTBEAT_S:
            chunks.append(": still here\n\n")
        if chunks:
            try:
                await response.write("".join(chunks).encode())
            except (ConnectionResetError, RuntimeError):
                break  # the browser went away
            last_write = time.monotonic()
        if not shown:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(console.closing.wait(), POLL_S)
    return response


async def record(request: web.Request) -> web.Response:
    """One record: its headers, key and value as ``headwater log view --format json`` gives
    them, its first bytes in hex, and the value as indented JSON when it is JSON."""
    console = request.app[CONSOLE_KEY]
    q = request.query
    try:
        topic, partition, offset = q["topic"], int(q["partition"]), int(q["offset"])
    except (KeyError, ValueError):
        raise web.HTTPBadRequest(text="topic, partition and offset are required") from None
    try:
        found = await console.run(console.bus.read, topic, partition, offset, 1)
    except (UnknownTopic, UnknownPartition) as e:
        raise web.HTTPNotFound(text=str(e)) from None
    if not found or found[0].offset != offset:
        raise web.HTTPNotFound(text=f"no record at {topic}[{partition}]@{offset}")
    r = found[0]
    out = record_to_json(r)
    out["hex"] = r.value[:256].hex(" ")
    try:
        out["json"] = json.dumps(json.loads(r.value), indent=2, ensure_ascii=False)
    except (ValueError, UnicodeDecodeError):
        out["json"] = None
    return web.json_response(out)
