"""Benchmark of the webhook transport (issue 10): messages/s end to end (intake -> receiver ->
callback to the sender) and latency from intake to the receiver, for the embedded state
(SQLite) and for Redis, against a bare aiohttp client posting the same signed messages to the
same receiver, and against the floor (the same exchanges through a relay that keeps nothing),
in the same run.

Run from the repository root::

    .venv/bin/python bench/webhooks.py                  # both states, about 2 minutes
    .venv/bin/python bench/webhooks.py --quick          # fewer messages, about a minute
    .venv/bin/python bench/webhooks.py --format json    # the figures as JSON on stdout

Processes (all on loopback, all sharing this machine's cores):

- the receiver (aiohttp, uvloop): ``POST /hooks`` answered 200 with a small JSON result (a sync
  response), ``POST /callback`` (the sender's) 200; it notes when each message arrived;
- headwater as ``headwater up`` runs it without Spark: the intake in ``collector.workers``
  processes, the webhook workers in the one holding the log; state embedded or Redis;
- the load: ``headwater.testing.load.http1.post_concurrently``, ``--concurrency`` in flight.

Figures:

1. Reference: the bare client POSTs ``--messages`` signed messages (Standard Webhooks headers,
   headwater's signer) straight to the receiver: messages/s.
2. End to end, per state: the client POSTs the messages to ``/webhooks/{source}`` (each
   answered 202 once durable on the log); the time from the first POST to the last callback
   at the sender: messages/s, and the ratios to the reference and to the floor.
3. The floor: the same load through a relay that keeps nothing (``--role relay``): three HTTP
   exchanges per message (intake, delivery, callback) with no state and no log. Each state
   runs ``--rounds`` times, each run between two floor runs: its ratio is to the mean of those
   two (this VM's speed drifts by up to a third within minutes), and the median round is the
   state's figures.
4. Unloaded latency, per state: 300 messages one at a time, 20 ms apart: intake (the POST
   sent) -> the receiver got it, p50/p99.
5. Latency under a steady load, per state: 500 messages/s for 10 s, each POST sent on time
   (an open loop): intake -> the receiver, p50/p99.

Targets (issue 10): >= 5,000 messages/s end to end with the embedded state, and >= 50% of the
bare client's rate; p99 intake -> receiver <= 100 ms unloaded (both states). Against the floor,
in the same run (issue 38): the embedded state >= 0.7x the floor end to end, Redis >= 0.5x; p99
intake -> receiver at 500 messages/s <= 50 ms (both states).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Target,
    arguments,
    emit_json,
    machine_info,
    percentile,
    print_table,
    progress,
    scratch_directory,
    serve_app,
    serving_child,
)
from headwater.testing.load.http1 import post_concurrently

SECRET = "whsec_" + base64.b64encode(b"b" * 32).decode()
KEY = "bench-key"
LATENCY_MESSAGES = 300
PACED_RATE, PACED_S = 500, 10.0  # the latency under a steady load (issue 38)
PAYLOAD = {"event": "build.finished", "repo": "headwater", "ref": "main", "n": 0}
# a state's figures, in the report's columns
STATE_COLUMNS = (
    "end_to_end_per_s",
    "intake_per_s",
    "ratio_to_bare",
    "ratio_to_floor",
    "latency_p50_ms",
    "latency_p99_ms",
)


# -- the receiver (a child process) ------------------------------------------------------------
def receiver_main(port_file: Path) -> None:
    from aiohttp import web

    arrivals: dict[str, float] = {}
    callbacks = 0
    result = b'{"ok":1}'

    async def hooks(request: web.Request) -> web.Response:
        await request.read()
        arrivals.setdefault(request.headers.get("webhook-id", ""), time.time())
        return web.Response(body=result, content_type="application/json")

    async def callback(request: web.Request) -> web.Response:
        nonlocal callbacks
        await request.read()
        callbacks += 1
        return web.Response(status=200)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"posts": len(arrivals), "callbacks": callbacks})

    async def arrived(request: web.Request) -> web.Response:
        return web.json_response(arrivals)

    async def reset(request: web.Request) -> web.Response:
        nonlocal callbacks
        arrivals.clear()
        callbacks = 0
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks", hooks)
    app.router.add_post("/callback", callback)
    app.router.add_get("/stats", stats)
    app.router.add_get("/arrivals", arrived)
    app.router.add_post("/reset", reset)
    serve_app(app, port_file)


# -- the floor: the same three exchanges with no state and no log (a child process) ------------
def relay_main(receiver: str, port_file: Path, concurrency: int) -> None:
    """What any transport shaped like this one pays on this machine's stack before it keeps
    anything: aiohttp's server takes the message (auth, JSON) and answers 202; ``concurrency``
    workers sign it, POST it to the receiver with headwater's HTTP client and POST the response
    to the sender's callback. Nothing is stored, deduplicated or retried."""
    import orjson
    from aiohttp import web

    from headwater.http.client import HttpClient
    from headwater.webhooks.signing import Signer

    signer = Signer.from_secrets([SECRET])
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def intake(request: web.Request) -> web.Response:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return web.Response(status=401)
        doc = orjson.loads(await request.read())
        queue.put_nowait((doc["message_id"], orjson.dumps(doc["payload"])))
        return web.json_response({"status": "accepted"}, status=202)

    async def worker(client: HttpClient) -> None:
        while True:
            mid, body = await queue.get()
            headers = {"content-type": "application/json", **signer.headers(mid, body)}
            r = await client.request("POST", f"{receiver}/hooks", headers=headers, body=body)
            await client.request("POST", f"{receiver}/callback", headers=headers, body=r.body)

    async def workers(app: web.Application) -> AsyncIterator[None]:
        async with HttpClient() as client:
            tasks = [asyncio.create_task(worker(client)) for _ in range(concurrency)]
            yield
            for task in tasks:
                task.cancel()

    app = web.Application()
    app.router.add_post("/webhooks/app", intake)
    app.cleanup_ctx.append(workers)
    serve_app(app, port_file)


# -- headwater (a child process) ---------------------------------------------------------------
def headwater_main(config_file: Path, port_file: Path) -> None:
    from headwater.config.loader import load_config
    from headwater.roles.up import Listen, run

    config = load_config(config_file)

    def echo(line: str) -> None:
        if line.startswith("headwater: health at "):
            port_file.write_text(line.split(" at ", 1)[1].removesuffix("/healthz"))

    # as `headwater up` runs it: the intake in `collector.workers` processes (one per core)
    run(config, Listen("127.0.0.1", 0, None), echo=echo, with_webhooks=True)


def child(
    role: str, directory: Path, *args: str
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], str]]:
    """This script in ``role`` in a child process: (it, what it serves on)."""
    command = [sys.executable, __file__, "--role", role, *args]
    return serving_child(command, directory / f"{role}.port", directory / f"{role}.log")


# -- the load --------------------------------------------------------------------------------
async def bare_client(receiver: str, n: int, concurrency: int) -> float:
    """Messages/s of the load client POSTing signed messages straight to the receiver."""
    from headwater.webhooks.signing import Signer

    signer = Signer.from_secrets([SECRET])

    def signed(i: int) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({**PAYLOAD, "n": i}, separators=(",", ":")).encode()
        return body, {"content-type": "application/json", **signer.headers(f"ref-{i}", body)}

    seconds = await post_concurrently(
        f"{receiver}/hooks", (signed(i) for i in range(n)), concurrency, 200
    )
    return n / seconds


async def end_to_end(hw: str, receiver: str, n: int, concurrency: int, tag: str) -> dict[str, Any]:
    """Post ``n`` messages to the intake; time until the sender has every callback."""
    import aiohttp

    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    docs = (
        {"message_id": f"{tag}-{i}", "receiver": "rx", "payload": {**PAYLOAD, "n": i}}
        for i in range(n)
    )
    started = time.perf_counter()
    bodies = ((json.dumps(doc).encode(), headers) for doc in docs)
    intake_s = await post_concurrently(f"{hw}/webhooks/app", bodies, concurrency, 202)
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{receiver}/stats") as r:
                stats = await r.json()
            if stats["callbacks"] >= n:
                break
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"not every callback arrived: {stats}")
            await asyncio.sleep(0.05)
    total_s = time.perf_counter() - started
    return {"messages": n, "intake_per_s": n / intake_s, "end_to_end_per_s": n / total_s}


async def latency(hw: str, receiver: str, tag: str) -> dict[str, float]:
    import aiohttp

    auth = {"authorization": f"Bearer {KEY}"}
    sent: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for i in range(LATENCY_MESSAGES):
            mid = f"{tag}-lat-{i}"
            sent[mid] = time.time()
            doc = {"message_id": mid, "receiver": "rx", "payload": PAYLOAD}
            async with session.post(f"{hw}/webhooks/app", json=doc, headers=auth) as r:
                await r.read()
            await asyncio.sleep(0.02)
        arrivals = await _arrivals(session, receiver, sent)
    delays = sorted((arrivals[m] - t) * 1000 for m, t in sent.items() if m in arrivals)
    return {
        "latency_p50_ms": percentile(delays, 50),
        "latency_p99_ms": percentile(delays, 99),
        "latency_max_ms": delays[-1],
        "latency_lost": len(sent) - len(delays),
    }


async def paced_latency(
    hw: str, receiver: str, tag: str, rate: int, seconds: float
) -> dict[str, float]:
    """Latency from intake to the receiver under a steady load: ``rate`` messages a second for
    ``seconds``, each POST sent on time (an open loop: a slow answer does not delay the next),
    then p50/p99 of when the receiver got each."""
    import aiohttp

    auth = {"authorization": f"Bearer {KEY}"}
    sent: dict[str, float] = {}
    n = int(rate * seconds)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def post(mid: str) -> None:
            doc = {"message_id": mid, "receiver": "rx", "payload": PAYLOAD}
            sent[mid] = time.time()
            async with session.post(f"{hw}/webhooks/app", json=doc, headers=auth) as r:
                await r.read()
                if r.status != 202:
                    raise RuntimeError(f"the intake answered {r.status}")

        started = time.monotonic()
        posts = []
        for i in range(n):
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            posts.append(asyncio.create_task(post(f"{tag}-paced-{i}")))
        await asyncio.gather(*posts)
        arrivals = await _arrivals(session, receiver, sent)
    delays = sorted((arrivals[m] - t) * 1000 for m, t in sent.items() if m in arrivals)
    return {
        "paced_rate_per_s": rate,
        "paced_p50_ms": percentile(delays, 50),
        "paced_p99_ms": percentile(delays, 99),
        "paced_lost": len(sent) - len(delays),
    }


async def _arrivals(session: Any, receiver: str, sent: dict[str, float]) -> dict[str, float]:
    """When the receiver got each of ``sent`` (waiting up to a minute for the last)."""
    deadline = time.monotonic() + 60
    while True:
        async with session.get(f"{receiver}/arrivals") as r:
            arrivals: dict[str, float] = await r.json()
        if all(m in arrivals for m in sent) or time.monotonic() > deadline:
            return arrivals
        await asyncio.sleep(0.05)


def write_config(directory: Path, receiver: str, state: dict[str, Any]) -> Path:
    from headwater.collector.auth import hash_key

    doc = {
        "data_dir": str(directory / "data"),
        "bus": {"embedded": {"durability": "always"}},
        "webhooks": {
            "state": state,
            "receivers": [{"name": "rx", "url": f"{receiver}/hooks", "secret": SECRET}],
            "sources": [
                {
                    "id": "app",
                    "write_keys": [hash_key(KEY)],
                    "callback_url": f"{receiver}/callback",
                    "secret": SECRET,
                }
            ],
        },
    }
    path = directory / f"headwater-{state['backend']}.yaml"
    path.write_text(json.dumps(doc))
    return path


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    import urllib.request

    from headwater.testing.redis import start_redis

    n = args.messages or (5_000 if args.quick else 20_000)
    results: dict[str, Any] = {"machine": machine_info(directory), "messages": n}
    with child("receiver", directory) as (_, port), start_redis() as redis:
        receiver = f"http://127.0.0.1:{port}"

        loads = itertools.count()

        def loaded(url: str, what: str) -> dict[str, Any]:
            """A warm-up, then ``n`` messages end to end through ``url``; the receiver's
            counts reset before each."""
            runs = next(loads)  # (every run's message ids its own: headwater dedups them)
            for count, tag in ((min(n, 2000), f"warm{runs}"), (n, f"run{runs}")):
                urllib.request.urlopen(urllib.request.Request(f"{receiver}/reset", method="POST"))
                progress(f"{what}: {count} messages end to end ({tag})")
                figures = asyncio.run(end_to_end(url, receiver, count, args.concurrency, tag))
            return figures

        progress(f"reference: a bare aiohttp client, {n} signed messages to the receiver")
        asyncio.run(bare_client(receiver, min(n, 2000), args.concurrency))  # warm-up
        results["bare_client_per_s"] = asyncio.run(bare_client(receiver, n, args.concurrency))
        relay_args = ("--receiver", receiver, "--concurrency", str(args.concurrency))
        states = {
            "embedded": {"backend": "embedded"},
            "redis": {"backend": "redis", "redis_url": redis.url},
        }
        floors: list[float] = []
        with child("relay", directory, *relay_args) as (_, relay_port):
            relay = f"http://127.0.0.1:{relay_port}"

            def floor() -> float:
                per_s = loaded(relay, "floor (no state, no log)")["end_to_end_per_s"]
                floors.append(per_s)
                return float(per_s)

            for name, state in states.items():
                (directory / name).mkdir(exist_ok=True)
                config = write_config(directory / name, receiver, state)
                hw_args = ("--config", str(config))
                with child(f"headwater-{name}", directory / name, *hw_args) as (_, hw):
                    run_state = functools.partial(loaded, hw, f"{name} state")
                    figures = rounds(args.rounds, floor, run_state)
                    figures |= measure_latency(hw, receiver, name)
                    figures["ratio_to_bare"] = (
                        figures["end_to_end_per_s"] / results["bare_client_per_s"]
                    )
                    results[name] = figures
        results["floor_per_s"] = statistics.median(floors)
        results["floor_runs_per_s"] = floors
    return results


def rounds(
    n: int, floor: Callable[[], float], loaded: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``n`` rounds of a floor run then a state's run, and a last floor run: each state run's
    ratio to the mean of the floor runs on either side of it (this VM's speed drifts by up to
    a third within minutes: a floor measured minutes away can move a ratio by 0.1). The state's
    figures are those of its median round."""
    before = floor()
    runs = []
    for _ in range(n):
        figures = loaded()
        after = floor()
        figures["floor_per_s"] = (before + after) / 2
        figures["ratio_to_floor"] = figures["end_to_end_per_s"] / figures["floor_per_s"]
        runs.append(figures)
        before = after
    ratios = [f["ratio_to_floor"] for f in runs]  # (in the order they ran)
    median = dict(sorted(runs, key=lambda f: f["ratio_to_floor"])[(len(runs) - 1) // 2])
    median["ratios_to_floor"] = ratios
    return median


def measure_latency(hw: str, receiver: str, name: str) -> dict[str, Any]:
    """Unloaded, then at ``PACED_RATE`` messages/s."""
    progress(f"{name} state: unloaded latency, {LATENCY_MESSAGES} messages")
    figures = asyncio.run(latency(hw, receiver, "idle"))
    progress(f"{name} state: latency at {PACED_RATE} messages/s for {PACED_S:.0f} s")
    return figures | asyncio.run(paced_latency(hw, receiver, "paced", PACED_RATE, PACED_S))


def targets(results: dict[str, Any]) -> list[Target]:
    """Issue 10's targets, and the floor's ratios an open issue sets (same run)."""
    e, r = results["embedded"], results["redis"]
    same_run = "same run, same load"
    return [
        Target("embedded state, end to end", e["end_to_end_per_s"], 5000, "msgs/s", same_run),
        Target("embedded state / the bare client", e["ratio_to_bare"], 0.5, "x", same_run),
        Target("embedded state / the floor relay", e["ratio_to_floor"], 0.7, "x", same_run),
        Target("Redis state / the floor relay", r["ratio_to_floor"], 0.5, "x", same_run),
        *(
            Target(
                f"p99 intake -> receiver, {name} state",
                results[name]["latency_p99_ms"],
                100,
                "ms",
                f"unloaded: {LATENCY_MESSAGES} messages 20 ms apart",
                higher_is_better=False,
            )
            for name in ("embedded", "redis")
        ),
        *(
            Target(
                f"p99 intake -> receiver at {PACED_RATE}/s, {name} state",
                results[name]["paced_p99_ms"],
                50,
                "ms",
                f"{PACED_RATE} messages/s for {PACED_S:.0f} s, an open loop",
                higher_is_better=False,
            )
            for name in ("embedded", "redis")
        ),
    ]


def report(results: dict[str, Any]) -> None:
    bare, floor = results["bare_client_per_s"], results["floor_per_s"]
    rows: list[list[object]] = [
        ["bare aiohttp client -> receiver", bare, None, 1.0, None, None, None],
        ["floor: 3 exchanges, no state, no log", floor, None, floor / bare, 1.0, None, None],
    ]
    for name in ("embedded", "redis"):
        rows.append([f"headwater, {name} state", *(results[name][k] for k in STATE_COLUMNS)])
    print(f"{results['messages']} messages, {results['machine']['cpus']} cores")
    headers = ["run", "msgs/s end to end", "intake/s", "x bare", "x floor", "p50 ms", "p99 ms"]
    print(print_table(headers, rows))
    floors = ", ".join(f"{f:,.0f}" for f in results["floor_runs_per_s"])
    print(f"floor runs: {floors} msgs/s")
    for name in ("embedded", "redis"):
        r = results[name]
        ratios = ", ".join(f"{x:.3f}" for x in r["ratios_to_floor"])
        print(f"{name} state / its floor, each round in order: {ratios}")
        print(
            f"{name} state at {r['paced_rate_per_s']}/s: p50 {r['paced_p50_ms']:.1f} ms, "
            f"p99 {r['paced_p99_ms']:.1f} ms to the receiver ({r['paced_lost']} not arrived)"
        )
    print("targets:")
    print("\n".join(f"  {t.verdict()}" for t in targets(results)))


def main() -> None:
    parser = arguments(__doc__, quick="5,000 messages", markdown=False)
    parser.add_argument(
        "--role", choices=["receiver", "relay", "headwater-embedded", "headwater-redis"]
    )
    parser.add_argument("--receiver", default="")
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--config", type=Path)
    parser.add_argument("--messages", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of each state, each between two floor runs (the median round is reported)",
    )
    args = parser.parse_args()
    if args.role == "receiver":
        receiver_main(args.port_file)
        return
    if args.role == "relay":
        relay_main(args.receiver, args.port_file, args.concurrency)
        return
    if args.role is not None:
        headwater_main(args.config, args.port_file)
        return
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with scratch_directory(args.dir, "webhooks-", keep=args.keep) as directory:
        results = run(args, directory)
    if args.format == "json":
        emit_json({**results, "targets": [t.as_json() for t in targets(results)]})
    else:
        report(results)


if __name__ == "__main__":
    main()
