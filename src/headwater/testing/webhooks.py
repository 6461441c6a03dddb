"""A real HTTP webhook receiver (or sender's callback endpoint) for tests: an aiohttp server on
a free loopback port, in a thread of its own, that records every request, verifies its Standard
Webhooks signature with the ``standardwebhooks`` library, and answers as the test scripts it:
any status, body and headers (a 429 with Retry-After), a delay (a timeout), or a reset after
reading the body (the ambiguous failure: the request arrived, its answer did not)::

    with running_receiver(SECRET, script=lambda n, r: Reply(503) if n < 2 else Reply(200, b"{}"))
        as receiver:
        ... receiver.url, receiver.status_url ...
        receiver.requests  # every request, with .verified

``GET /status/{message_id}`` answers 404 for a message never received, else what
``status_script`` says (default: 200 with the result it was answered with, or 202 when the
message was accepted without one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

if TYPE_CHECKING:
    from concurrent.futures import Future

    from headwater.config.model import HeadwaterConfig
    from headwater.webhooks.config import WebhooksConfig
    from headwater.webhooks.receiving import Receiving
    from headwater.webhooks.state import MessageState, StateStore

T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    reset: bool = False  # close the connection after reading the body, with no answer


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    message_id: str
    headers: dict[str, str]
    body: bytes
    at: float
    verified: bool


Script = Callable[[int, Received], Reply]  # (how many requests came before, this one)


@dataclass
class Receiver:
    url: str
    status_url: str
    requests: list[Received] = field(default_factory=list)
    answered: dict[str, Reply] = field(default_factory=dict)  # last successful reply per id

    def posts(self, message_id: str | None = None) -> list[Received]:
        return [
            r
            for r in self.requests
            if r.method == "POST" and (message_id is None or r.message_id == message_id)
        ]


def _verifier(secret: str | None) -> Callable[[bytes, dict[str, str]], bool]:
    if secret is None:
        return lambda body, headers: False
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    hook = Webhook(secret)

    def verified(body: bytes, headers: dict[str, str]) -> bool:
        try:
            hook.verify(body, headers, json_parse=False)
        except WebhookVerificationError:
            return False
        return True

    return verified


@contextmanager
def running_receiver(
    secret: str | None,
    script: Script | None = None,
    status_script: Script | None = None,
) -> Iterator[Receiver]:
    """Serve until the block ends; ``secret`` (whsec_...) verifies the signatures."""
    verified = _verifier(secret)
    receiver = Receiver(url="", status_url="")
    lock = threading.Lock()

    def record(request: web.Request, body: bytes) -> Received:
        headers = {k.lower(): v for k, v in request.headers.items()}
        received = Received(
            request.method,
            request.path,
            request.match_info.get("message_id") or headers.get("webhook-id", ""),
            headers,
            body,
            time.time(),
            verified(body, headers),
        )
        with lock:
            receiver.requests.append(received)
        return received

    async def post(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        received = record(request, body)
        with lock:
            count = len(receiver.requests) - 1
        reply = script(count, received) if script else Reply()
        if 200 <= reply.status < 300 and not reply.reset:
            receiver.answered[received.message_id] = reply
        return await answer(request, reply)

    async def status(request: web.Request) -> web.StreamResponse:
        received = record(request, b"")
        if status_script is not None:
            with lock:
                count = len(receiver.requests) - 1
            return await answer(request, status_script(count, received))
        if not receiver.posts(received.message_id):
            return web.Response(status=404)
        done = receiver.answered.get(received.message_id)
        if done is None or not done.body:
            return web.Response(status=202)
        return web.Response(status=200, body=done.body)

    app = web.Application()
    app.router.add_post("/hooks", post)
    app.router.add_get("/status/{message_id}", status)
    with serving_app(app, "test-receiver") as port:
        receiver.url = f"http://127.0.0.1:{port}/hooks"
        receiver.status_url = f"http://127.0.0.1:{port}/status/{{message_id}}"
        yield receiver


async def answer(request: web.Request, reply: Reply) -> web.StreamResponse:
    """Answer as ``reply`` says: after its delay, or by cutting the connection."""
    if reply.delay_s:
        await asyncio.sleep(reply.delay_s)
    if reply.reset:
        assert request.transport is not None
        request.transport.abort()
        return web.Response(status=499)  # never arrives: the connection is gone
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


@contextmanager
def serving_app(app: web.Application, name: str) -> Iterator[int]:
    """Serve ``app`` on a free loopback port (yielded) from a thread of its own until the
    block ends."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server  # aiohttp keeps the bound socket here
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def run_steps(
    store: StateStore,
    config: WebhooksConfig,
    responded: list[MessageState],
    make: Callable[[Receiving], Awaitable[T]],
) -> T:
    """Run ``make`` (a worker step) with a fresh HTTP session; what the steps hand to the
    sender is appended to ``responded``."""
    from headwater.webhooks.receiving import Receiving

    async def go() -> T:
        from headwater.http.client import HttpClient

        async with HttpClient() as session:

            async def respond(state: MessageState) -> None:
                responded.append(state)

            ctx = Receiving(store, config, session, respond)
            try:
                return await make(ctx)
            finally:
                await ctx.state.close()

    return asyncio.run(go())


@dataclass
class RunningHeadwater:
    """``serve`` (the collector with its webhook intake and the webhook workers) in a thread."""

    url: str
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event
    done: Future[None]
    lines: list[str]
    console_url: str | None = None  # when the config lists admin tokens

    def stop(self, timeout: float = 60.0) -> None:
        """Stop gracefully, as on SIGTERM; re-raises what ``serve`` raised."""
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.done.result(timeout)


@contextmanager
def running_headwater(
    config: HeadwaterConfig,
    *,
    with_webhooks: bool = True,
    with_pipeline: bool = False,
    timeout: float = 60.0,
) -> Iterator[RunningHeadwater]:
    """Serve ``config`` on a free loopback port (no gRPC; the pipeline ``with_pipeline``, on
    the process's SparkSession) until the block ends."""
    import queue

    from headwater.roles.up import Listen, serve

    config = config.model_copy(
        update={"collector": config.collector.model_copy(update={"grpc_port": None})}
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-headwater", daemon=True)
    thread.start()

    async def make_event() -> asyncio.Event:
        return asyncio.Event()

    stop = asyncio.run_coroutine_threadsafe(make_event(), loop).result(timeout)
    done = asyncio.run_coroutine_threadsafe(
        serve(
            config,
            Listen("127.0.0.1", 0, None),
            echo=lines.put,
            stop=stop,
            with_pipeline=with_pipeline,
            with_webhooks=with_webhooks,
        ),
        loop,
    )
    deadline = time.monotonic() + timeout
    url = ""
    ready = False
    while not ready:
        if done.done():
            done.result()  # serve ended early: raise its error
            raise AssertionError(f"headwater stopped before it was ready: {seen}")
        try:
            line = lines.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise AssertionError(f"headwater was not ready in time: {seen}") from None
            continue
        seen.append(line)
        if line.startswith("headwater: health at "):
            url = line.split(" at ", 1)[1].removesuffix("/healthz")
        ready = line.startswith("headwater: ready")
    console = next((x for x in seen if x.startswith("headwater: console at ")), None)
    running = RunningHeadwater(
        url, loop, stop, done, seen, console.split(" at ", 1)[1].rstrip("/") if console else None
    )
    try:
        yield running
    finally:
        if not done.done():
            running.stop(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()


def post_json(
    url: str, doc: object, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, dict[str, object]]:
    """POST ``doc`` as JSON (``bytes`` as they are); (status, the JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    request = urllib.request.Request(
        url, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    return _answer(request, timeout)


def get_json(
    url: str, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, dict[str, object]]:
    import urllib.request

    return _answer(urllib.request.Request(url, headers=headers or {}), timeout)


def _answer(request: object, timeout: float) -> tuple[int, dict[str, object]]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # type: ignore[arg-type]
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"{}")
