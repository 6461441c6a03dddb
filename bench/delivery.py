"""Benchmark of HTTP delivery's core (issue 11), before it is a pipeline destination: what one
Spark task's ``TaskDelivery`` delivers per second to a local receiver, against a bare aiohttp
client posting the same request bodies to the same receiver in the same run.

Run from the repository root::

    .venv/bin/python bench/delivery.py               # 300,000 events, about a minute
    .venv/bin/python bench/delivery.py --events 100000 --sessions 1000

The receiver is an aiohttp server in its own process that un-gzips each body and counts its
lines (NDJSON); answering in ``--delay-ms`` (0 by default). The events are ~300-byte JSON
objects spread over ``--sessions`` session keys, NDJSON, gzip, ``max_batch_bytes`` 1 MB (so a
run makes many requests per session). The reference POSTs the very bodies the sender made
(recorded in a first pass), with as many requests in flight as the sender may have sessions.

Issue 11's target is for the pipeline destination (>= 100,000 events/s delivered, >= 70% of the
bare client); this measures the part of it that runs in a task, without Spark and the steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_directory, print_table, progress


def receiver_main(port_file: Path, delay_ms: float) -> None:
    import uvloop
    from aiohttp import web

    counted = {"events": 0, "requests": 0}

    async def ingest(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp undoes a gzip Content-Encoding
        if body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
        counted["events"] += body.count(b"\n")
        counted["requests"] += 1
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        return web.Response(status=200)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counted)

    async def main() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/ingest", ingest)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_file.write_text(str(site._server.sockets[0].getsockname()[1]))  # type: ignore[union-attr]
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


@contextlib.contextmanager
def receiver(directory: Path, delay_ms: float) -> Iterator[str]:
    port_file = directory / "receiver.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "receiver",
            "--port-file",
            str(port_file),
            "--delay-ms",
            str(delay_ms),
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the receiver did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/ingest"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def make_events(n: int, sessions: int) -> list[tuple[str, object]]:
    from headwater.delivery.bodies import Event

    rng = random.Random(5)
    out = []
    for i in range(n):
        key = f"user-{rng.randrange(sessions)}"
        doc = {
            "user_id": key,
            "event": rng.choice(["page", "click", "purchase"]),
            "n": i,
            "url": f"https://example.com/p/{rng.randrange(10_000)}",
            "props": {"ref": "campaign-" + str(rng.randrange(100)), "x": rng.random()},
            "pad": "y" * 120,
        }
        out.append((key, Event(json.dumps(doc).encode(), ts_ns=1_700_000_000_000_000_000 + i)))
    return out


async def headwater_task(url: str, items: list, sessions: int) -> tuple[float, list[bytes]]:
    from headwater.delivery.config import HttpDeliveryConfig
    from headwater.delivery.sender import Sender
    from headwater.delivery.sessions import TaskDelivery
    from headwater.http_client import HttpClient

    config = HttpDeliveryConfig(
        url=url, max_batch_bytes=1_000_000, max_parallel_sessions=min(sessions, 64)
    )
    bodies: list[bytes] = []
    async with HttpClient() as http:
        sender = Sender(config, http)
        original = sender._request

        async def recording(body: bytes, headers: dict[str, str]) -> object:
            bodies.append(body)
            return await original(body, headers)

        sender._request = recording  # type: ignore[method-assign]
        started = time.perf_counter()
        report = await TaskDelivery(sender, "bench", 1).run(items)
        elapsed = time.perf_counter() - started
    assert report.outcome.delivered == len(items), report.outcome
    return len(items) / elapsed, bodies


async def bare_client(url: str, bodies: list[bytes], events: int, parallel: int) -> float:
    import aiohttp

    queue = iter(bodies)
    headers = {"content-type": "application/x-ndjson", "content-encoding": "gzip"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            for body in queue:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(parallel)))
        return events / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["receiver"])
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if args.role == "receiver":
        receiver_main(args.port_file, args.delay_ms)
        return
    directory = bench_directory(args.dir, "delivery-")
    progress(f"making {args.events} events over {args.sessions} sessions")
    items = make_events(args.events, args.sessions)
    with receiver(directory, args.delay_ms) as url:
        asyncio.run(headwater_task(url, items[: min(20_000, len(items))], args.sessions))  # warm
        progress("headwater's task delivery")
        rate, bodies = asyncio.run(headwater_task(url, items, args.sessions))
        progress(f"the bare client: the same {len(bodies)} bodies")
        bare = asyncio.run(bare_client(url, bodies, len(items), min(args.sessions, 64)))
    rows = [
        ["headwater TaskDelivery (one task)", f"{rate:,.0f}", f"{rate / bare:.2f}"],
        ["bare aiohttp client, same bodies", f"{bare:,.0f}", "1.00"],
    ]
    print(f"{args.events} events, {args.sessions} sessions, {len(bodies)} requests")
    print(print_table(["run", "events/s", "x bare"], rows))


if __name__ == "__main__":
    main()
