"""Benchmark of the webhook workers scaled out (issue 38): two ``headwater webhooks`` processes
on one Redis state and one Kafka broker, against one, under the same load.

Run from the repository root::

    .venv/bin/python bench/webhooks_scale.py                # 20,000 messages a case, ~4 min
    .venv/bin/python bench/webhooks_scale.py --quick        # 5,000
    .venv/bin/python bench/webhooks_scale.py --format json

Processes (all on loopback, all sharing this machine's cores):

- Apache Kafka, one broker (``_common.kafka_broker``), and Redis (``headwater.testing.redis``);
- the receiver of ``bench/webhooks.py``: ``POST /hooks`` answered with a small JSON result,
  ``POST /callback`` (the sender's) counted;
- ``headwater collector`` (the intake: ``POST /webhooks/app`` onto ``webhooks.from_sender``,
  two partitions);
- ``headwater webhooks``: one process, then two (the second joins the same consumer groups and
  takes half the ``from_sender`` partitions and some of the receivers: each
  ``to_receiver.<r>`` has one partition, so the messages go to ``RECEIVERS`` receivers in turn);
- the load: ``post_concurrently``, 64 in flight, as in ``bench/webhooks.py``.

Figures, per case: messages/s end to end (the first POST until the sender has every callback),
the CPU each process took a message, and how busy the machine was. The ratio of two processes
to one is the target's figure (>= 1.6x where the machine has the cores); on 2 cores the broker,
Redis, the collector, the receiver and the load share them with the workers, and the report
says what the machine allowed: with one process it was already this busy, so a second could
at most take the idle rest (``machine_allows`` = 1 / busy). The rate limits held across
processes are checked by ``tests/webhooks/test_processes.py`` (three processes, 2,000 messages
under 50/s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import webhooks as single
from _common import (
    Target,
    arguments,
    emit_json,
    kafka_broker,
    machine_busy_between,
    machine_info,
    print_table,
    progress,
    sample_tree,
    scratch_directory,
)
from headwater.testing.collector import CollectorProcess
from headwater.testing.load.http1 import post_concurrently

RECEIVERS = 8
WORKER_ROLE = ("webhooks", "--port", "0")
COLLECTOR_ROLE = ("collector", "--port", "0", "--grpc-port", "0")


def write_config(directory: Path, bootstrap: str, redis_url: str, receiver: str) -> Path:
    from headwater.collector.auth import hash_key

    doc = {
        "data_dir": str(directory / "data"),
        "collector": {"workers": 1},
        "bus": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap}},
        "webhooks": {
            "topic_prefix": f"wh{uuid.uuid4().hex[:6]}.",
            "state": {
                "backend": "redis",
                "redis_url": redis_url,
                "redis_prefix": f"bench:{uuid.uuid4().hex[:6]}:",
            },
            "receivers": [
                {"name": f"rx{i}", "url": f"{receiver}/hooks", "secret": single.SECRET}
                for i in range(RECEIVERS)
            ],
            "sources": [
                {
                    "id": "app",
                    "write_keys": [hash_key(single.KEY)],
                    "callback_url": f"{receiver}/callback",
                    "secret": single.SECRET,
                }
            ],
        },
    }
    path = directory / "headwater.yaml"
    path.write_text(json.dumps(doc))
    return path


@contextlib.contextmanager
def role(
    config: Path, directory: Path, what: tuple[str, ...], n: int
) -> Iterator[tuple[CollectorProcess, int]]:
    """``headwater <what>`` as a child process, once healthy: (it, its HTTP port)."""
    stderr = directory / f"{what[0]}-{n}.log"
    process = CollectorProcess(config, stderr, what)
    try:
        yield process, process.wait_healthy()
        process.stop()  # gracefully, as SIGTERM does
    finally:
        process.close()


async def through(url: str, receiver: str, n: int, tag: str) -> float:
    """``n`` messages to the receivers in turn; messages/s until every callback arrived."""
    import aiohttp

    urllib.request.urlopen(urllib.request.Request(f"{receiver}/reset", method="POST"))
    headers = {"authorization": f"Bearer {single.KEY}", "content-type": "application/json"}
    bodies = (
        (
            json.dumps(
                {"message_id": f"{tag}-{i}", "receiver": f"rx{i % RECEIVERS}", "payload": {"n": i}}
            ).encode(),
            headers,
        )
        for i in range(n)
    )
    started = time.perf_counter()
    await post_concurrently(f"{url}/webhooks/app", bodies, 64, 202)
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{receiver}/stats") as r:
                stats = await r.json()
            if stats["callbacks"] >= n:
                break
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"not every callback arrived: {stats}")
            await asyncio.sleep(0.05)
    return n / (time.perf_counter() - started)


def measured(url: str, receiver: str, n: int, tag: str, pids: dict[str, int]) -> dict[str, Any]:
    """A warm-up, then ``n`` messages end to end, with each process's CPU a message."""
    asyncio.run(through(url, receiver, min(n, 4000), f"{tag}-warm"))
    before = {name: sample_tree(pid) for name, pid in pids.items()}
    per_s = asyncio.run(through(url, receiver, n, tag))
    after = {name: sample_tree(pid) for name, pid in pids.items()}
    first = next(iter(before))
    return {
        "end_to_end_per_s": per_s,
        "machine_busy": machine_busy_between(before[first], after[first]),
        "cpu_us_per_message": {
            name: (after[name].cpu_s - before[name].cpu_s) / n * 1e6 for name in pids
        },
    }


def run(n: int, directory: Path) -> dict[str, Any]:
    from headwater.testing.redis import start_redis

    results: dict[str, Any] = {"machine": machine_info(directory), "messages": n}
    with (
        kafka_broker() as kafka,
        start_redis() as redis,
        single.child("receiver", directory) as (receiver_proc, port),
    ):
        receiver = f"http://127.0.0.1:{port}"
        config = write_config(directory, kafka.bootstrap_servers, redis.url, receiver)
        broker = kafka.nodes[0].process
        assert broker is not None
        with role(config, directory, COLLECTOR_ROLE, 0) as (collector, http_port):
            url = f"http://127.0.0.1:{http_port}"
            pids = {
                "kafka": broker.pid,
                "redis": redis.pid,
                "collector": collector.proc.pid,
                "receiver": receiver_proc.pid,
            }
            with role(config, directory, WORKER_ROLE, 1) as (first, _):
                progress(f"one webhooks process: {n} messages to {RECEIVERS} receivers")
                one = pids | {"webhooks-1": first.proc.pid}
                results["one"] = measured(url, receiver, n, "one", one)
                with role(config, directory, WORKER_ROLE, 2) as (second, _):
                    progress(f"two webhooks processes: {n} messages")
                    two = one | {"webhooks-2": second.proc.pid}
                    results["two"] = measured(url, receiver, n, "two", two)
    results["ratio"] = results["two"]["end_to_end_per_s"] / results["one"]["end_to_end_per_s"]
    # what the machine left for a second process: at most the idle share of the one case
    results["machine_allows"] = 1 / results["one"]["machine_busy"]
    return results


def targets(results: dict[str, Any]) -> list[Target]:
    busy = results["two"]["machine_busy"]
    return [
        Target(
            "two webhooks processes / one, on one Redis",
            results["ratio"],
            1.6,
            "x",
            f"same load, same machine ({results['machine']['cpus']} cores, {busy:.0%} busy)",
        )
    ]


def report(results: dict[str, Any]) -> None:
    rows: list[list[object]] = []
    for case in ("one", "two"):
        r = results[case]
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us_per_message"].items())
        rows.append([case, r["end_to_end_per_s"], f"{r['machine_busy']:.0%}", cpu])
    print(f"{results['messages']} messages to {RECEIVERS} receivers, one Redis, one broker")
    print(print_table(["webhooks processes", "msgs/s", "machine busy", "CPU us/msg"], rows))
    print(
        f"two / one: {results['ratio']:.2f}x; the machine allowed at most "
        f"{results['machine_allows']:.2f}x (one process left it "
        f"{1 - results['one']['machine_busy']:.0%} idle)"
    )
    print("targets:")
    print("\n".join(f"  {t.verdict()}" for t in targets(results)))


def main() -> None:
    parser = arguments(__doc__, quick="5,000 messages a case", markdown=False)
    parser.add_argument("--messages", type=int, default=0)
    args = parser.parse_args()
    n = args.messages or (5_000 if args.quick else 20_000)
    with scratch_directory(args.dir, "webhooks-scale-", keep=args.keep) as directory:
        results = run(n, directory)
    if args.format == "json":
        emit_json({**results, "targets": [t.as_json() for t in targets(results)]})
    else:
        report(results)


if __name__ == "__main__":
    main()
