"""Benchmark of the ``http`` destination (issue 11): events/s delivered to a local receiver
through the pipeline, and the delivery's own part in one task, each against a bare aiohttp client
posting the same request bodies to the same receiver in the same run.

Run from the repository root::

    .venv/bin/python bench/delivery.py                          # both parts, ~3 minutes
    .venv/bin/python bench/delivery.py --skip-task              # the pipeline cases only
    .venv/bin/python bench/delivery.py --skip-pipeline --sessions 1000

The receiver is an aiohttp server in its own process that un-gzips each body and counts its
lines (NDJSON), answering at once or in 50 ms. Events are ~300-byte JSON objects; NDJSON, gzip
(level 1), at most 64 sessions sending at once per task.

1. **The pipeline** (Spark ``local[2]``, the embedded log): ``--pipeline-events`` events
   (default 500k; docs/benchmarks.md reports 1M), one batch run (start and stop included) of an
   ``http`` destination with ``group_by`` over 100 sessions, 1 MB bodies; the reference POSTs
   the bodies the receiver got, 64 at a time. Then against a 50 ms receiver with 64 kB bodies:
   10, 100 and 1,000 sessions.
2. **One task's delivery** (``--events`` rows over ``--sessions`` keys, as a task hands them
   over): packs per session, batches, gzip, one request in flight per session, and the bare
   client posting the very bodies it sent, ``--runs`` times in one process (the first run is
   a fresh process's; a pipeline's Python workers are reused from batch to batch). 3M events
   by default: a session's batch is full after ~3,300 events, so a shorter stream would send
   all its batches only once every event has been made into a batch, with nothing to overlap.

Targets (issue 11): >= 100,000 events/s delivered through the pipeline with 100 sessions, and
>= 70% of the bare client's rate; throughput grows with sessions against a 50 ms receiver.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import arguments, print_table, progress, scratch_directory, serve_app, serving_child
from headwater.testing.load.http1 import post_concurrently

PIPELINE_TOPIC = "events-delivery"
SLOW_BATCH_BYTES = 65_536  # bodies of the 50 ms receiver's cases: many requests per session


def receiver_main(port_file: Path, delay_ms: float) -> None:
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

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/ingest", ingest)
    app.router.add_get("/stats", stats)
    app.router.add_post("/reset", reset)
    app.router.add_post("/dump", dump)
    serve_app(app, port_file)


@contextlib.contextmanager
def receiver(directory: Path, delay_ms: float) -> Iterator[str]:
    """The receiver in a child process; its URL."""
    command = [sys.executable, __file__, "--role", "receiver", "--delay-ms", str(delay_ms)]
    with serving_child(command, directory / "receiver.port") as (_, port):
        yield f"http://127.0.0.1:{port}/ingest"


def make_rows(n: int, sessions: int) -> list[object]:
    """~300-byte events over ``sessions`` session keys, as a task's archive rows (8,192 a
    chunk): the event's JSON, its time and its session key."""
    import pyarrow as pa

    rng = random.Random(5)
    chunks = []
    for first in range(0, n, 8192):
        texts, keys = [], []
        for i in range(first, min(first + 8192, n)):
            key = f"user-{rng.randrange(sessions)}"
            doc = {
                "user_id": key,
                "event": rng.choice(["page", "click", "purchase"]),
                "n": i,
                "url": f"https://example.com/p/{rng.randrange(10_000)}",
                "props": {"ref": "campaign-" + str(rng.randrange(100)), "x": rng.random()},
                "pad": "y" * 120,
            }
            texts.append(json.dumps(doc))
            keys.append(key)
        stamps = pa.array([1_700_000_000_000_000] * len(texts), pa.timestamp("us", tz="UTC"))
        chunks.append(pa.table({"event": texts, "_timestamp": stamps, "_hw_session": keys}))
    return chunks


async def headwater_task(url: str, chunks: list, sessions: int) -> tuple[float, list[bytes]]:
    """What one task's delivery thread does with its rows: packs per session, batches,
    gzip, one request in flight per session."""
    from headwater.delivery.config import HttpDeliveryConfig
    from headwater.delivery.sender import Sender
    from headwater.delivery.sessions import TaskDelivery
    from headwater.delivery.task import items
    from headwater.http.client import HttpClient

    config = HttpDeliveryConfig(
        url=url, max_batch_bytes=1_000_000, max_parallel_sessions=min(sessions, 64)
    )
    bodies: list[bytes] = []
    events = sum(c.num_rows for c in chunks)
    async with HttpClient() as http:
        sender = Sender(config, http)
        original = sender._request

        async def recording(body: bytes, headers: dict[str, str]) -> object:
            bodies.append(body)
            return await original(body, headers)

        sender._request = recording  # type: ignore[method-assign]
        delivery = TaskDelivery(sender, "bench", 1)
        room = delivery.batch_room()

        async def stream() -> AsyncIterator[list[tuple[str, object]]]:
            for chunk in chunks:
                yield items(chunk, "none", sender.format, room)

        started = time.perf_counter()
        report = await delivery.run(stream())
        elapsed = time.perf_counter() - started
    assert report.outcome.delivered == events, report.outcome
    return events / elapsed, bodies


async def bare_client(url: str, bodies: list[bytes], events: int, parallel: int) -> float:
    """Events/s of the reference: the same gzipped NDJSON bodies POSTed, ``parallel`` at a time."""
    headers = {"content-type": "application/x-ndjson", "content-encoding": "gzip"}
    return events / await post_concurrently(url, ((b, headers) for b in bodies), parallel)


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
        with receiver(directory, 50.0) as url:
            run_pipeline(spark, directory / "warm", url, 20_000, "/s10")
            for sessions in (10, 100, 1000):
                progress(f"pipeline -> http answering in 50 ms, {sessions} sessions, 64 kB bodies")
                log, n = directory / "log", args.pipeline_events
                rate = run_pipeline(
                    spark, log, url, n, f"/s{sessions}", max_batch_bytes=SLOW_BATCH_BYTES
                )
                rows.append([f"pipeline -> http, {sessions} sessions", f"{rate:,.0f}", "", "50"])
    finally:
        spark.stop()
    return rows


def main() -> None:
    parser = arguments(__doc__, output=False)
    parser.add_argument("--role", choices=["receiver"])
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--events", type=int, default=3_000_000)
    parser.add_argument("--runs", type=int, default=3, help="measured runs of one task's case")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--pipeline-events", type=int, default=500_000)
    parser.add_argument("--skip-task", action="store_true")
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    if args.role == "receiver":
        receiver_main(args.port_file, args.delay_ms)
        return
    with scratch_directory(args.dir, "delivery-", keep=args.keep) as directory:
        if not args.skip_task:
            task_case(args, directory)
        if not args.skip_pipeline:
            rows = pipeline_cases(args, directory)
            print(f"{args.pipeline_events} events through the pipeline (local[2])")
            print(print_table(["run", "events/s", "x bare", "receiver ms"], rows))


def task_case(args: argparse.Namespace, directory: Path) -> None:
    progress(f"making {args.events} events over {args.sessions} sessions")
    chunks = make_rows(args.events, args.sessions)
    rows, ratios = [], []
    with receiver(directory, args.delay_ms) as url:
        asyncio.run(headwater_task(url, chunks[:3], args.sessions))  # warm
        for run in range(1, args.runs + 1):
            progress(f"run {run}: headwater's task delivery, then the bare client")
            rate, bodies = asyncio.run(headwater_task(url, chunks, args.sessions))
            bare = asyncio.run(bare_client(url, bodies, args.events, min(args.sessions, 64)))
            ratios.append(rate / bare)
            rows.append([f"run {run}", f"{rate:,.0f}", f"{bare:,.0f}", f"{rate / bare:.2f}"])
    print(f"{args.events} events, {args.sessions} sessions, {len(bodies)} requests a run")
    print(print_table(["one task's delivery", "headwater events/s", "bare client", "x bare"], rows))
    print(f"median x bare: {sorted(ratios)[len(ratios) // 2]:.2f}")


if __name__ == "__main__":
    main()
