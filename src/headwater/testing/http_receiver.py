"""A real HTTP receiver of batches for the ``http`` destination's tests: an aiohttp server on a
free loopback port, in a thread of its own, that records every request (its session, its
idempotency key, its events, decompressed), notes any moment when two requests of one session
were in flight at once (seed D1: the test fails on it), and answers as the test scripts it:
503 with Retry-After, 429, 413 above a body size, a stall, a reset.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from headwater.delivery.sender import IDEMPOTENCY_HEADER, SESSION_HEADER
from headwater.testing.webhooks import Reply, answer, serving_app


@dataclass(frozen=True)
class Batch:
    session: str
    key: str
    events: list[Any]  # the decoded events (for dataset: the events' attrs)
    body_bytes: int  # before compression
    started: float
    status: int


BatchScript = Callable[[int, "Batch"], Reply]  # (requests before this one, this one)


@dataclass
class BatchReceiver:
    url: str = ""
    requests: list[Batch] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)  # sessions seen with 2 requests at once

    def delivered(self) -> list[Batch]:
        return [b for b in self.requests if 200 <= b.status < 300]


def decode_events(body: bytes, content_type: str) -> list[Any]:
    if content_type.startswith("application/x-ndjson"):
        return [json.loads(line) for line in body.splitlines() if line]
    doc = json.loads(body)
    if isinstance(doc, dict) and "events" in doc:
        return [e["attrs"] for e in doc["events"]]
    return list(doc)


@contextmanager
def running_batch_receiver(
    script: BatchScript | None = None, max_body_bytes: int | None = None
) -> Iterator[BatchReceiver]:
    """Serve until the block ends; bodies over ``max_body_bytes`` (decompressed) get 413."""
    receiver = BatchReceiver()
    lock = threading.Lock()
    in_flight: dict[str, int] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        started = time.time()
        session = request.headers.get(SESSION_HEADER, "")
        with lock:
            in_flight[session] = in_flight.get(session, 0) + 1
            if in_flight[session] > 1:
                receiver.overlaps.append(session)
        try:
            raw = await request.read()  # aiohttp has undone a gzip Content-Encoding already
            body = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            events = decode_events(body, request.headers.get("content-type", ""))
            key = request.headers.get(IDEMPOTENCY_HEADER, "")
            probe = Batch(session, key, events, len(body), started, 0)
            with lock:
                count = len(receiver.requests)
            if max_body_bytes is not None and len(body) > max_body_bytes:
                reply = Reply(413, b"too large")
            else:
                reply = script(count, probe) if script else Reply(200, b"{}")
            with lock:
                receiver.requests.append(
                    Batch(session, key, events, len(body), started, reply.status)
                )
            return await answer(request, reply)
        finally:
            with lock:
                in_flight[session] -= 1

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    with serving_app(app, "test-batch-receiver") as port:
        receiver.url = f"http://127.0.0.1:{port}/ingest"
        yield receiver
