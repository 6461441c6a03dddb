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

PIPELINE_TOPIC = "events-delivery"
SLOW_BATCH_BYTES = 65_536  # bodies of the 50 ms receiver's cases: many requests per session


def receiver_main(port_file: Path, delay_ms: float) -> None:
    import uvloop
    from aiohttp import web

    counted = {"events": 0, "requests": 0}
    recorded: list[bytes] = []  # bodies as received (decompressed), while recording

    async def ingest(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp undoes a gzip Content-Encoding
        if body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
        counted["events"] += body.count(b"\n")
        counted["requests"] += 1
        if counted.get("recording"):
            recorded.append(body)
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        return web.Response(status=200)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counted)

    async def reset(request: web.Request) -> web.Response:
        counted.update(events=0, requests=0, recording=request.query.get("record") == "1")
        recorded.clear()
        return web.Response(status=204)

    async def dump(request: web.Request) -> web.Response:
        Path(request.query["to"]).write_bytes(b"".join(recorded))
        sizes = [len(b) for b in recorded]
        return web.json_response(sizes)

    async def main() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/ingest", ingest)
        app.router.add_get("/stats", stats)
        app.router.add_post("/reset", reset)
        app.router.add_post("/dump", dump)
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
    port_file.unlink(missing_ok=True)
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


# -- through the pipeline ------------------------------------------------------------------------
def pipeline_messages(n: int, seed: int = 11) -> Iterator[object]:
    """~300-byte events as the collector writes them (context in headers), each with its
    session keys for 10, 100 and 1,000 sessions (``s10``, ``s100``, ``s1000``)."""
    from headwater.bus import Message
    from headwater.bus import context as ctx

    rng = random.Random(seed)
    for i in range(n):
        user = rng.randrange(1000)
        doc = {
            "event": rng.choice(["page", "click", "purchase"]),
            "n": i,
            "s10": f"u{user % 10}",
            "s100": f"u{user % 100}",
            "s1000": f"u{user}",
            "url": f"https://example.com/p/{rng.randrange(10_000)}",
            "props": {"ref": "campaign-" + str(rng.randrange(100)), "x": rng.random()},
            "pad": "y" * 60,
        }
        headers = (
            (ctx.TYPE, b"track"),
            (ctx.CONTENT_TYPE, b"application/json"),
            (ctx.EVENT_ID, f"ev-{i}".encode()),
            (ctx.RECEIVED_AT, b"2026-11-25T12:00:00.000Z"),
        )
        yield Message(json.dumps(doc).encode(), key=f"u{user}".encode(), headers=headers)


def fill_log(directory: Path, n: int) -> None:
    from headwater.bus import open_bus

    with open_bus(pipeline_config(directory, [])) as bus:
        bus.create_topic(PIPELINE_TOPIC, 2)
        chunk = []
        for m in pipeline_messages(n):
            chunk.append(m)
            if len(chunk) == 5_000:
                bus.append(PIPELINE_TOPIC, chunk).result()
                chunk = []
        if chunk:
            bus.append(PIPELINE_TOPIC, chunk).result()
        bus.flush()


def pipeline_config(directory: Path, destinations: list[dict[str, object]]) -> object:
    from headwater.config.model import HeadwaterConfig

    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(directory),
            "bus": {"embedded": {"durability": "never", "default_partitions": 2}},
            "pipeline": {"destinations": destinations},
        }
    )


def http_destination(
    dest_id: str, url: str, group_by: str | None, max_batch_bytes: int
) -> dict[str, object]:
    return {
        "id": dest_id,
        "type": "http",
        "mode": "batch",
        "topics": [PIPELINE_TOPIC],
        "max_records_per_trigger": 10_000_000,
        "options": {
            "url": url,
            "format": "ndjson",
            "group_by": [group_by] if group_by else [],
            "max_batch_bytes": max_batch_bytes,
            "max_parallel_sessions": 64,
        },
    }


def post(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, method="POST")) as r:
        return bytes(r.read())


def run_pipeline(
    spark: object,
    directory: Path,
    url: str,
    n: int,
    group_by: str | None,
    *,
    record: bool = False,
    max_batch_bytes: int = 1_000_000,
) -> float:
    """Events/s of one batch run of an http destination over the ``n`` events on the log."""
    import urllib.request

    from headwater.pipeline.runner import Pipeline

    base = url.rsplit("/", 1)[0]
    post(f"{base}/reset?record={int(record)}")
    dest_id = f"api-{(group_by or 'task').strip('/')}-{time.monotonic_ns()}"
    pipeline = Pipeline(
        pipeline_config(directory, [http_destination(dest_id, url, group_by, max_batch_bytes)]),
        spark,
    )
    started = time.perf_counter()
    try:
        pipeline.run_once()
    finally:
        pipeline.stop()
    seconds = time.perf_counter() - started
    phases = pipeline.queries[0].writer.phases
    progress("  phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    with urllib.request.urlopen(f"{base}/stats") as r:
        got = json.loads(r.read())
    if got["events"] != n:
        raise RuntimeError(f"the receiver got {got['events']} events of {n}")
    return n / seconds


def recorded_bodies(url: str, directory: Path) -> list[bytes]:
    """The bodies the receiver recorded, gzip'd again (level 1, as the destination sends)."""
    path = directory / "bodies.bin"
    sizes = json.loads(post(f"{url.rsplit('/', 1)[0]}/dump?to={path}"))
    data, out, at = path.read_bytes(), [], 0
    for size in sizes:
        out.append(gzip.compress(data[at : at + size], compresslevel=1))
        at += size
    path.unlink()
    return out


def pipeline_cases(args: argparse.Namespace, directory: Path) -> list[list[str]]:
    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import spark_session

    rows = []
    progress(f"filling the log: {args.pipeline_events:,} events (and 20,000 to warm up)")
    fill_log(directory / "log", args.pipeline_events)
    fill_log(directory / "warm", 20_000)
    progress("starting Spark (local[2])")
    spark = spark_session(SparkConfig(master="local[2]"), app_name="headwater-bench-delivery")
    try:
        with receiver(directory, 0.0) as url:
            run_pipeline(spark, directory / "warm", url, 20_000, "/s100")
            progress(f"pipeline -> http, {args.pipeline_events:,} events, 100 sessions")
            rate = run_pipeline(
                spark, directory / "log", url, args.pipeline_events, "/s100", record=True
            )
            bodies = recorded_bodies(url, directory)
            progress(f"the bare client: the same {len(bodies)} bodies, 64 at a time")
            bare = asyncio.run(bare_client(url, bodies, args.pipeline_events, 64))
            rows.append(
                ["pipeline -> http, 100 sessions", f"{rate:,.0f}", f"{rate / bare:.2f}", "0"]
            )
            rows.append(["bare aiohttp client, same bodies", f"{bare:,.0f}", "1.00", "0"])
            progress(f"pipeline -> http, {args.pipeline_events:,} events, a session per task")
            rate = run_pipeline(spark, directory / "log", url, args.pipeline_events, None)
            rows.append(["pipeline -> http, a session per task", f"{rate:,.0f}", "", "0"])
        with receiver(directory, 50.0) as url:
            run_pipeline(spark, directory / "warm", url, 20_000, "/s10")
            for sessions in (10, 100, 1000):
                progress(f"pipeline -> http answering in 50 ms, {sessions} sessions, 64 kB bodies")
                rate = run_pipeline(
                    spark,
                    directory / "log",
                    url,
                    args.pipeline_events,
                    f"/s{sessions}",
                    max_batch_bytes=SLOW_BATCH_BYTES,
                )
                rows.append([f"pipeline -> http, {sessions} sessions", f"{rate:,.0f}", "", "50"])
    finally:
        spark.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["receiver"])
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--pipeline-events", type=int, default=500_000)
    parser.add_argument("--skip-task", action="store_true")
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if args.role == "receiver":
        receiver_main(args.port_file, args.delay_ms)
        return
    directory = bench_directory(args.dir, "delivery-")
    if not args.skip_task:
        task_case(args, directory)
    if not args.skip_pipeline:
        rows = pipeline_cases(args, directory)
        print(f"{args.pipeline_events} events through the pipeline (local[2])")
        print(print_table(["run", "events/s", "x bare", "receiver ms"], rows))


def task_case(args: argparse.Namespace, directory: Path) -> None:
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
