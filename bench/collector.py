"""Benchmark of the collector: Raccoon events over WebSocket, REST and gRPC into the embedded log.

Run from the repository root::

    .venv/bin/python bench/collector.py                 # the full run, under 4 minutes
    .venv/bin/python bench/collector.py --quick         # a smoke run, under 60 s
    .venv/bin/python bench/collector.py --format json   # the same figures as JSON on stdout
    .venv/bin/python bench/collector.py --bus kafka     # on Kafka vs the log, and vs Raccoon

The collector runs as ``headwater --config FILE collector --port 0 --grpc-port 0`` runs it, its
log under ``./data`` (``--dir``), ``collector.workers: auto`` (an intake process per core): its
CPU, RSS and PSS are all its processes' together, "loop thread" the busiest event loop. The load
comes from this script in load-generator processes (uvloop, the clients of
``headwater.testing.load``, pre-built request bytes; ``--grpc-client aio``: grpc.aio's client,
2-3x the CPU a call), on the same cores over loopback; the generators' CPU is printed.

Workload: Raccoon ``SendEventRequest``s of 100 events of 200 bytes (type ``click``; 21,351
bytes as protobuf), each with its own ``req_guid``. What is measured, in one run:

1. WebSocket, ``ack: durable``, 1, 100 and 1,000 connections (``--quick``: 1 and 100), each
   connection with its own ``X-User-ID`` and at most 4 requests in flight, sending the next as soon
   as one is acked (closed loop: saturation); 10 s after 2 s of warm-up (``--quick``: 3 s after
   1 s). Then a paced run at 100k events/s (the target) over the largest connection count: the ack
   latency at the target load. Figures: events/s, ack latency p50/p95/p99 (send to ack, measured by
   the client), the collector's CPU (all threads, and its event-loop thread alone), CPU per event,
   its RSS, the generator's CPU, the whole machine's.
2. REST ``POST /api/v1/events`` (``application/proto``, keep-alive, 50 concurrent) and
3. gRPC ``EventService/SendEvent`` (50 concurrent calls on one HTTP/2 connection, as one
   client channel carries them), both with ``ack: durable``.
4. The collector's RSS with 10,000 idle WebSocket connections (``--quick``: 2,000, extrapolated),
   each having sent one batch, opened from two processes on their own 127.0.0.x addresses, on a
   fresh collector.
5. The raw log: the same records (the collector's decoder and record builder make them from the
   same request) appended to an ``EmbeddedBus`` in this process with durability ``always`` by 64
   asyncio appenders, as ``bench/bus.py`` does, and the ratio collector / raw log.

Targets (issue 14): with ``ack: durable``, WebSocket >= 150k events/s with 1 and with 100
connections, REST and gRPC >= 120k; p95 ack latency <= 20 ms at 1k connections paced at 100k
events/s; <= 250 MB for the whole collector (PSS summed over its processes) with 10k idle
connections. A miss is printed with by how much; a throughput or latency miss is profiled with
py-spy on the collector under load (``$PY_SPY``, ``py-spy`` next to this Python, or on ``PATH``).
This is not a test: it exits 0 unless it fails. Every child process ends itself (time limits,
and when this script goes away).

``--bus kafka`` measures the collector on Apache Kafka against the embedded log in one run (under
4 minutes, ``--quick`` about 1): the durable closed-loop cases (1)-(3) on a collector on the log,
then on a fresh collector with ``bus.backend: kafka`` (``ack: durable`` waits for ``acks=all``, with
the broker's default flush policy: no fsync before the ack; topics of 2 partitions, as on the log)
on one broker (``headwater.testing.kafka``, KRaft on loopback, JVM ``_common.KAFKA_JVM``) started
after the embedded cases, or on ``--brokers 3`` (replication 3, ``min.insync.replicas`` 2). A fresh
broker's JVM spends up to a core compiling in its first seconds of load, so WebSocket x100 runs
8 s first, not recorded. Per case: both figures and the ratio Kafka / embedded, with the brokers'
CPU (they share the 2 cores) and peak RSS (VmHWM, taken before Raccoon's cases).

Then, on the same broker before it is stopped, the peer (issue 37): Raccoon v0.3.0, the Go event
collector whose protocol headwater speaks (``--raccoon PATH``, default ``$HEADWATER_RACCOON``, else
``~/.cache/headwater/raccoon/raccoon-v0.3.0``), run as ``raccoon server`` configured by its
environment: WebSocket/REST and gRPC on free ports (it binds every interface, and its pprof
server binds localhost:6060, a port it cannot be told to move: the bench checks that it is free),
``EVENT_ACK=1`` (acked after Kafka's delivery report; librdkafka's default ``acks=all``),
``WORKER_POOL_SIZE=50``, and ``EVENT_DISTRIBUTION_PUBLISHER_PATTERN=bench-raccoon-%s`` (topic
``bench-raccoon-click``, created beforehand with the 2 partitions headwater's topics get, not
left to auto-creation). It is ready when ``GET /ping`` answers, its gRPC port accepts and a REST
batch is acked. The same closed-loop cases drive it with the same load generators (gRPC calls
add the ``x-user-id`` metadata Raccoon requires; a case it cannot run is skipped with the reason),
measured as the collector is (CPU and RSS of its one process, the broker's CPU). Per case:
headwater on Kafka / Raccoon events/s, both p99s, both collector CPU per event, both broker
CPUs. Without the binary the run says so, with how to build it, and goes on. Targets: the
embedded's (issue 14) and issue 37's on Kafka: WebSocket x100 >= 1.0x Raccoon's events/s, its
p99 <= 200 ms and <= 4 us of collector CPU per event, WebSocket x1 >= 100k events/s; on three
brokers the same within 25%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from _common import (
    MB,
    PY_SPY_MISSING,
    ChildLines,
    ProcessSample,
    Steal,
    Target,
    arguments,
    broker_figures,
    cores_between,
    find_py_spy,
    fmt_number,
    kafka_broker,
    machine_busy_between,
    machine_info,
    machine_line,
    output,
    parse_py_spy_raw,
    percentile,
    print_table,
    progress,
    py_spy_record_pid,
    raise_fd_limit,
    run_facts,
    sample_process,
    sample_tree,
    say,
    scratch_directory,
)
from headwater.testing.load.grpc import SEND_EVENT as GRPC_METHOD
from headwater.testing.load.grpc import GrpcConnection
from headwater.testing.load.http1 import HttpClient, HttpLoad, post_head
from headwater.testing.load.requests import (
    GUID_LEN,
    Guids,
    Stats,
    reply_problem,
    request_template,
    with_guid,
)
from headwater.testing.load.websocket import RequestFrames, WsClient, WsLoad, open_websockets, pace
from headwater.testing.ports import free_port

if TYPE_CHECKING:
    from headwater.testing.kafka import KafkaCluster

HOST = "127.0.0.1"
PATH = "/api/v1/events"
EVENTS_PER_BATCH = 100
EVENT_BYTES = 200
IN_FLIGHT = 4  # requests a WebSocket connection may have sent and not yet seen acked
HTTP_CONCURRENCY = 50
IDLE_CONNECTIONS = 10_000
IDLE_SOURCES = ("127.0.0.2", "127.0.0.3")
RAW_APPENDERS = 64

TARGET_EVENTS_S = 150_000.0  # WebSocket, durable, with 1 and with 100 connections (issue 14)
TARGET_HTTP_EVENTS_S = 120_000.0  # REST and gRPC, durable
TARGET_PACED_EVENTS_S = 100_000.0  # the paced run whose p95 is judged, at 1,000 connections
TARGET_P95_MS = 20.0
TARGET_IDLE_RSS_MB = 250.0  # the whole collector (all its processes), 10k idle connections
PY_SPY_RATE = 100
GRPC_ROLES = {"raw": "grpc-load", "aio": "grpc-aio-load"}  # --grpc-client: the load's role
PARTITIONS = 2  # of the collector's topic, on the log and on Kafka (the buses' default)

# the peer on Kafka (issue 37): Raccoon v0.3.0, started on the broker headwater's cases used
RACCOON = "raccoon"  # LoadFigure.bus of its cases
RACCOON_DEFAULT = Path("~/.cache/headwater/raccoon/raccoon-v0.3.0").expanduser()
RACCOON_BUILD = (
    "git clone --depth 1 --branch v0.3.0 https://github.com/raystack/raccoon && cd raccoon && "
    "CGO_ENABLED=1 GOFLAGS=-mod=mod /usr/local/go/bin/go build "
    "-o ~/.cache/headwater/raccoon/raccoon-v0.3.0 ."
)
RACCOON_TOPIC_PATTERN = "bench-raccoon-%s"  # %s: the event's type ("click": one topic)
RACCOON_WORKERS = 50
RACCOON_PPROF_PORT = 6060  # fixed in v0.3.0 (localhost); it exits when it cannot bind it
RACCOON_IDENTITY = "bench-grpc"  # its gRPC calls must name a connection (x-user-id)
RACCOON_START_S = 60.0

TARGET_OVER_RACCOON = 1.0  # issue 37, on Kafka: WebSocket x100 events/s / Raccoon's
TARGET_KAFKA_P99_MS = 200.0  # at 100 connections
TARGET_KAFKA_US_PER_EVENT = 4.0  # collector CPU, WebSocket x100
TARGET_KAFKA_WS1_EVENTS_S = 100_000.0
CLUSTER_SLACK = 1.25  # three brokers: the same figures within 25%
WARM_UP_S = 8.0  # a round of the brokers' warm-up: WebSocket x100, then x1 for half of it
WARM_UP_MAX_S = 120.0
JIT_SETTLED_CORES = 0.15  # the brokers' JIT compilers under this in a round: warm


# -- the load generators (clients: headwater.testing.load) ------------------------------------
async def role_ws_load(args: argparse.Namespace) -> None:
    frames = RequestFrames(request_template(), os.urandom(4))
    load = WsLoad(HOST, args.port, f"w{args.index}", frames, IN_FLIGHT)
    clients, errors = await open_websockets(load, args.connections, args.source, 60)
    say({"ready": len(clients), "errors": errors[:3], "error_count": len(errors)})
    await read_stdin_line()  # "go"
    load.sending = True
    load.closed_loop = args.rate <= 0
    pacer = None
    if load.closed_loop:
        for client in clients:
            for _ in range(IN_FLIGHT):
                client.send_request()
    else:
        pacer = asyncio.create_task(pace(load, clients, args.rate / EVENTS_PER_BATCH))
    cpu_s = await load.stats.measure(args.warmup, args.duration)
    sent_in_window = load.stats.sent
    load.sending = False
    if pacer is not None:
        await pacer
    drain_until = time.perf_counter() + args.drain
    while time.perf_counter() < drain_until and any(c.pending for c in clients):
        await asyncio.sleep(0.05)
    lost = sum(1 for c in clients if c.lost.done())
    unacked = sum(len(c.pending) for c in clients)
    for client in clients:
        client.close()
    await asyncio.sleep(0.3)
    say(load.stats.result(cpu_s, args.duration, lost=lost, unacked=unacked, sent=sent_in_window))


async def role_ws_idle(args: argparse.Namespace) -> None:
    """Hold connections open and idle (after one acked batch each) until told to stop."""
    frames = RequestFrames(request_template(), os.urandom(4))
    load = WsLoad(HOST, args.port, f"i{args.index}", frames, IN_FLIGHT, closed_loop=False)
    clients, errors = await open_websockets(load, args.connections, args.source, args.max_seconds)
    gate = asyncio.Semaphore(16)  # a few batches at a time: per-connection retention, not a peak

    async def one_batch(client: WsClient) -> None:
        async with gate:
            client.acked = asyncio.Event()
            client.send_request()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.acked.wait(), 15)
            client.acked = None

    await asyncio.gather(*(one_batch(c) for c in clients))
    alive = sum(1 for c in clients if not c.lost.done())
    say(
        {
            "ready": alive,
            "errors": errors[:3],
            "error_count": len(errors),
            "unacked": sum(len(c.pending) for c in clients),
            "batch_errors": load.stats.error_samples,
        }
    )
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read_stdin_line(), args.max_seconds)
    for client in clients:
        if client.transport is not None:
            client.transport.abort()
    say({"done": True})


async def role_rest_load(args: argparse.Namespace) -> None:
    template = request_template()
    head = post_head(HOST, args.port, PATH, "application/proto", len(template))
    load = HttpLoad(f"r{args.index}", head, template)
    loop = asyncio.get_running_loop()
    clients: list[HttpClient] = []
    for i in range(args.connections):
        _, client = await loop.create_connection(lambda i=i: HttpClient(load, i), HOST, args.port)
        clients.append(client)
    say({"ready": len(clients), "errors": [], "error_count": 0})
    await read_stdin_line()
    load.sending = True
    for client in clients:
        client.send_request()
    cpu_s = await load.stats.measure(args.warmup, args.duration)
    load.sending = False
    await asyncio.sleep(0.5)
    lost = sum(1 for c in clients if c.lost.done())
    for client in clients:
        if client.transport is not None:
            client.transport.close()
    say(load.stats.result(cpu_s, args.duration, lost=lost))


async def role_grpc_load(args: argparse.Namespace) -> None:
    """The gRPC load: ``--connections`` concurrent unary calls on one HTTP/2 connection (as one
    channel of a gRPC client carries them), each starting the next when it is answered;
    ``--identity``: the ``x-user-id`` metadata of every call (Raccoon wants one)."""
    from headwater.collector.http2 import literal

    template = request_template()
    stats = Stats()
    sending = False
    conn: GrpcConnection

    def start(slot: Guids) -> None:
        guid = slot.next()
        stats.sent += 1
        conn.call(with_guid(template, guid), (slot, guid, time.perf_counter()))

    def on_reply(token: tuple[Guids, bytes, float], reply: bytes | None, problem: str) -> None:
        slot, guid, sent_at = token
        stats.answered(problem or reply_problem(reply or b"", guid), sent_at, "gRPC: ")
        if sending and not conn.lost.done():
            start(slot)

    def connection() -> GrpcConnection:
        made = GrpcConnection(f"{HOST}:{args.port}", GRPC_METHOD, on_reply)
        if args.identity:  # one more header in the block every call sends
            made.block += literal(b"x-user-id", args.identity.encode())
        return made

    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(connection, HOST, args.port)
    await asyncio.wait_for(conn.ready, 30)
    say({"ready": args.connections, "errors": [], "error_count": 0})
    await read_stdin_line()
    sending = True
    for i in range(args.connections):
        start(Guids(f"g{args.index}-{i:06d}-"))
    cpu_s = await stats.measure(args.warmup, args.duration)
    sending = False
    await asyncio.sleep(0.5)
    lost = int(conn.lost.done())
    conn.close()
    say(stats.result(cpu_s, args.duration, lost=lost))


async def role_grpc_aio_load(args: argparse.Namespace) -> None:
    """The gRPC load from grpc.aio's own client (one channel): ``--grpc-client aio``."""
    import grpc

    template = request_template()
    stats = Stats()
    sending = True
    metadata = (("x-user-id", args.identity),) if args.identity else None

    def same(data: bytes) -> bytes:
        return data

    async with grpc.aio.insecure_channel(f"{HOST}:{args.port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        send = channel.unary_unary(GRPC_METHOD, request_serializer=same, response_deserializer=same)

        async def caller(index: int) -> None:
            guids = Guids(f"g{args.index}-{index:06d}-")
            while sending:
                guid = guids.next()
                stats.sent += 1
                sent_at = time.perf_counter()
                try:
                    reply = await send(with_guid(template, guid), timeout=30, metadata=metadata)
                except grpc.aio.AioRpcError as e:
                    stats.error(f"gRPC {e.code().name}: {e.details()}")
                    continue
                stats.answered(reply_problem(reply, guid), sent_at)

        say({"ready": args.connections, "errors": [], "error_count": 0})
        await read_stdin_line()
        callers = [asyncio.create_task(caller(i)) for i in range(args.connections)]
        cpu_s = await stats.measure(args.warmup, args.duration)
        sending = False
        await asyncio.wait(callers, timeout=10)
    say(stats.result(cpu_s, args.duration))


# -- the collector process ------------------------------------------------------------------------
def role_collector(args: argparse.Namespace) -> None:
    """Run ``headwater --config FILE collector --port 0 --grpc-port 0`` in this process, ending
    it (SIGTERM, then exit) after ``--max-seconds`` or when the benchmark that started it is
    gone."""
    me = os.getpid()

    def stop() -> None:
        os.kill(me, signal.SIGTERM)  # a graceful stop first
        time.sleep(30)
        os._exit(5)

    guard(args.max_seconds, stop)
    gc_meter(Path(args.config).parent)
    from headwater.cli.main import cli

    command = ["--config", args.config, "collector", "--port", "0", "--grpc-port", "0"]
    cli.main(command, prog_name="headwater")


GC_STATS_GLOB = "gc-stats-*.json"


def gc_meter(directory: Path) -> None:
    """Time Python's cyclic garbage collector in this process and in every process it forks
    (the intake workers): ``gc.callbacks``, seconds and collections per generation, and seconds
    on the main thread, written to ``gc-stats-<pid>.json`` every 0.2 s for the benchmark to
    read."""
    import gc

    totals: dict[str, Any] = {}
    main = [0]
    began = [0.0]

    def reset() -> None:
        totals.update(seconds=[0.0, 0.0, 0.0], count=[0, 0, 0], main_s=0.0)
        main[0] = threading.get_ident()

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        spent = time.perf_counter() - began[0]
        generation = info["generation"]
        totals["seconds"][generation] += spent
        totals["count"][generation] += 1
        if threading.get_ident() == main[0]:
            totals["main_s"] += spent

    gc.callbacks.append(callback)

    def write() -> None:
        path = directory / GC_STATS_GLOB.replace("*", str(os.getpid()))
        scratch = path.with_suffix(".tmp")
        while True:
            scratch.write_text(json.dumps(totals))
            os.replace(scratch, path)
            time.sleep(0.2)

    def start() -> None:
        reset()
        threading.Thread(target=write, name="bench-gc-meter", daemon=True).start()

    start()
    os.register_at_fork(after_in_child=start)


# the collector's bus: the embedded log, or a Kafka broker (acks=all: the backend's producer)
EMBEDDED_BUS = """\
  backend: embedded
  embedded:
    durability: always
"""
KAFKA_BUS = """\
  backend: kafka
  kafka:
    bootstrap_servers: {servers}
    replication_factor: {replicas}
"""
COLLECTOR_CONFIG = """\
data_dir: {data_dir}
bus:
{bus}collector:
  host: {host}
  ack: {ack}
  raccoon:
    max_connections: {max_connections}
    max_connections_per_identity: 1
"""


@dataclass
class Collector:
    """A running collector process: its pid, ports and log."""

    proc: subprocess.Popen[bytes]
    ack: str
    port: int
    grpc_port: int
    log: IO[bytes]
    data_dir: Path
    bus: str = "embedded"
    broker_pids: tuple[int, ...] = ()  # the Kafka brokers it appends to

    @property
    def pid(self) -> int:
        return self.proc.pid

    def sample(self) -> ProcessSample:
        """The collector's process and its intake workers, together."""
        return sample_tree(self.pid)

    def gc_stats(self) -> dict[str, Any]:
        """What the garbage collector has cost so far in the collector's processes, summed
        (see ``gc_meter``)."""
        total: dict[str, Any] = {"seconds": [0.0, 0.0, 0.0], "count": [0, 0, 0], "main_s": 0.0}
        for path in self.data_dir.glob(GC_STATS_GLOB):
            with contextlib.suppress(OSError, ValueError):
                stats = json.loads(path.read_text())
                for i in range(3):
                    total["seconds"][i] += stats["seconds"][i]
                    total["count"][i] += stats["count"][i]
                total["main_s"] += stats["main_s"]
        return total


CHILDREN: list[subprocess.Popen[bytes]] = []


def spawn(command: Sequence[str], *, stderr: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own process group (ended with it), stdin/stdout pipes for its lines."""
    proc = subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
    )
    CHILDREN.append(proc)
    return proc


def role_command(role: str, **options: object) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role]
    for name, value in options.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return command


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child's process group (its own, by its pid) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


LINES: dict[int, ChildLines] = {}  # each child's, with what was read past a line


def read_json(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    """The child's next JSON line, within ``timeout_s``."""
    return LINES.setdefault(proc.pid, ChildLines(proc)).expect("", timeout_s)


def tell(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(line.encode() + b"\n")
        proc.stdin.flush()


async def read_stdin_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def start_collector(
    directory: Path, ack: str, max_seconds: float, *, kafka: KafkaCluster | None = None
) -> Collector:
    """A collector on the embedded log (durability always), or on ``kafka``'s broker."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"collector-{ack}-", dir=directory))
    config = data_dir / "headwater.yaml"
    bus = EMBEDDED_BUS
    if kafka is not None:
        bus = KAFKA_BUS.format(
            servers=json.dumps(kafka.bootstrap_servers), replicas=min(3, len(kafka.nodes))
        )
    config.write_text(
        COLLECTOR_CONFIG.format(
            data_dir=json.dumps(str(data_dir)),
            bus=bus,
            host=HOST,
            ack=ack,
            max_connections=20_000,
        )
    )
    log = open(data_dir / "collector.log", "w+b")  # noqa: SIM115 (closed in stop_collector)
    proc = spawn(
        role_command("collector", config=config, max_seconds=round(max_seconds)),
        stderr=log,
    )
    port = grpc_port = 0
    seen: list[str] = []

    def tail() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")[-800:]

    try:
        until = time.monotonic() + 60
        while time.monotonic() < until:
            line = LINES.setdefault(proc.pid, ChildLines(proc)).line(until - time.monotonic())
            if line is None:
                raise TimeoutError("no line within 60 s")
            seen.append(line)
            if found := re.search(r"health at http://[^:]+:(\d+)/", line):
                port = int(found.group(1))
            elif found := re.search(r"gRPC EventService on .*:(\d+)\s*$", line):
                grpc_port = int(found.group(1))
            elif line.startswith("headwater: ready"):
                break
    except (TimeoutError, RuntimeError) as e:
        kill(proc)
        raise RuntimeError(f"the collector did not start: {e}: {tail()}") from None
    if not port or not grpc_port:
        kill(proc)
        raise RuntimeError(f"the collector did not print its ports: {seen} {tail()}")
    on = "" if kafka is None else ", on Kafka"
    progress(f"collector (ack: {ack}{on}) pid {proc.pid} on port {port}, gRPC {grpc_port}")
    if kafka is None:
        return Collector(proc, ack, port, grpc_port, log, data_dir)
    return Collector(proc, ack, port, grpc_port, log, data_dir, "kafka", broker_pids(kafka))


def stop_collector(collector: Collector, grace_s: float = 30.0) -> None:
    end_child(collector.proc, "the collector", grace_s)
    collector.log.close()
    shutil.rmtree(collector.data_dir, ignore_errors=True)


def end_child(proc: subprocess.Popen[bytes], name: str, grace_s: float) -> None:
    """SIGTERM, ``grace_s`` to stop, then SIGKILL (its process group) and reap."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            progress(f"{name} did not stop within {grace_s:.0f} s of SIGTERM: killed")
    kill(proc)


# -- results --------------------------------------------------------------------------------------
@dataclass
class LoadFigure:
    """One load case against the collector: WebSocket, REST or gRPC."""

    protocol: str  # "WebSocket", "REST", "gRPC"
    ack: str
    connections: int
    load: str  # "closed" (as fast as acked) or "paced 100k/s"
    bus: str = "embedded"  # or "kafka"
    seconds: float = 0.0
    events_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p95_ms: float = float("nan")
    p99_ms: float = float("nan")
    errors: int = 0
    collector_cores: float = float("nan")
    loop_thread_cores: float = float("nan")  # the collector's main (event loop) thread
    gc_loop_cores: float = float("nan")  # of which in Python's cyclic GC
    full_gcs_per_s: float = float("nan")  # generation-2 collections per second
    collector_us_per_event: float = float("nan")
    collector_rss_mb: float = float("nan")
    generator_cores: float = float("nan")
    machine_cores: float = float("nan")  # busy cores of the whole machine (of 2)
    broker_cores: float = float("nan")  # the Kafka broker's, on the Kafka bus
    target_events_per_s: float | None = None
    note: str = ""

    @property
    def shape(self) -> str:
        """The case whatever the bus: what the same case on another bus shares."""
        return f"{self.protocol} {self.ack} x{self.connections} {self.load}"

    @property
    def case(self) -> str:
        return self.shape + ("" if self.bus == "embedded" else f" ({self.bus})")


@dataclass
class IdleFigure:
    connections: int = 0
    wanted: int = 0
    baseline_mb: float = float("nan")
    rss_mb: float = float("nan")
    per_connection_kb: float = float("nan")
    rss_at_10k_mb: float = float("nan")
    baseline_pss_mb: float = float("nan")
    pss_mb: float = float("nan")
    pss_at_10k_mb: float = float("nan")
    open_s: float = float("nan")
    note: str = ""


@dataclass
class RawFigure:
    records_per_s: float
    p50_ms: float
    p99_ms: float
    cores: float
    partitions: int
    appenders: int
    seconds: float
    record_bytes: int  # value + key + headers of one record as the collector makes it


@dataclass
class ProfileFigure:
    case: str
    seconds: int
    rate: int
    events_per_s: float
    threads: list[dict[str, Any]] = field(default_factory=list)  # per thread: busy, top frames
    categories: list[tuple[str, float]] = field(default_factory=list)  # main thread, by stage
    note: str = ""


@dataclass
class RaccoonRun:
    """The peer's part of a ``--bus kafka`` run: how Raccoon ran, or why it did not."""

    binary: str | None
    found: bool = False  # an executable at ``binary``
    measured: bool = False
    reason: str = ""  # why it was not measured (or stopped early)
    version: str = ""  # as it logs itself at start ("" for a plain ``go build``)
    topic: str = ""
    partitions: int = PARTITIONS
    environment: dict[str, str] = field(default_factory=dict)  # its configuration
    ready_s: float = float("nan")  # from start to the first acked batch
    skipped: list[str] = field(default_factory=list)  # cases it could not run, and why
    log_errors: int = 0  # error (and worse) lines in its log
    log_messages: list[tuple[str, int]] = field(default_factory=list)  # errors and warnings


@dataclass
class Run:
    args: argparse.Namespace
    directory: Path
    warmup: float
    seconds: float
    http_seconds: float
    connections: tuple[int, ...]
    idle_connections: int
    loads: list[LoadFigure] = field(default_factory=list)
    idle: IdleFigure | None = None
    raw: RawFigure | None = None
    targets: list[Target] = field(default_factory=list)
    profiles: list[ProfileFigure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    background_cores: float = float("nan")
    broker: dict[str, Any] | None = None  # --bus kafka: the broker's version, JVM, peak RSS
    raccoon: RaccoonRun | None = None  # --bus kafka: the peer on the same broker
    steal: Steal = field(default_factory=Steal)


# -- the measurements ---------------------------------------------------------------------------
def drive(
    collector: Collector,
    generators: Sequence[subprocess.Popen[bytes]],
    figure: LoadFigure,
    warmup: float,
    seconds: float,
    *,
    during: Callable[[], None] | None = None,
) -> LoadFigure:
    """Wait for the generators to connect, start them, sample the collector over the measured
    window, collect the generators' results into ``figure``."""
    try:
        ready = [read_json(g, 120) for g in generators]
        opened = sum(r["ready"] for r in ready)
        if opened < figure.connections:
            errors = sum(r["error_count"] for r in ready)
            figure.note += f"{opened}/{figure.connections} connected ({errors} errors: "
            figure.note += f"{[e for r in ready for e in r['errors']][:1]}) "
            if not opened:
                return figure
        for g in generators:
            tell(g, "go")
        time.sleep(warmup)
        before, gc_before = collector.sample(), collector.gc_stats()
        brokers = collector.broker_pids
        brokers_before = [sample_process(b) for b in brokers]
        if during is not None:
            during()
        else:
            time.sleep(seconds)
        after, gc_after = collector.sample(), collector.gc_stats()
        if brokers:
            figure.broker_cores = sum(
                cores_between(b, sample_process(pid))
                for b, pid in zip(brokers_before, brokers, strict=True)
            )
        results = [read_json(g, seconds + 60) for g in generators]
    finally:
        for g in generators:
            with contextlib.suppress(subprocess.TimeoutExpired):
                g.wait(10)
            kill(g)
    latencies = sorted(x for r in results for x in r["latencies_us"])
    acks = sum(r["acks"] for r in results)
    window = results[0]["window_s"]
    figure.seconds = window
    figure.events_per_s = acks * EVENTS_PER_BATCH / window
    figure.p50_ms, figure.p95_ms, figure.p99_ms = (
        percentile(latencies, q) / 1000 for q in (50, 95, 99)
    )
    figure.errors = sum(r["errors"] for r in results)
    figure.collector_cores = cores_between(before, after)
    figure.loop_thread_cores = max(
        after.threads.get(p, ("", 0.0))[1] - before.threads.get(p, ("", 0.0))[1] for p in after.pids
    ) / (after.at - before.at)
    figure.gc_loop_cores = (gc_after["main_s"] - gc_before["main_s"]) / (after.at - before.at)
    figure.full_gcs_per_s = (gc_after["count"][2] - gc_before["count"][2]) / (after.at - before.at)
    if collector.bus == RACCOON:  # one Go process: no event-loop thread, no Python GC
        figure.loop_thread_cores = figure.gc_loop_cores = figure.full_gcs_per_s = float("nan")
    if figure.events_per_s > 0:
        figure.collector_us_per_event = figure.collector_cores / figure.events_per_s * 1e6
    figure.collector_rss_mb = after.rss_mb
    figure.generator_cores = sum(r["cpu_s"] for r in results) / window
    figure.machine_cores = machine_busy_between(before, after) * (os.cpu_count() or 1)
    samples = [s for r in results for s in r["error_samples"]]
    if figure.errors or samples:
        figure.note += f"{figure.errors} errors in the window, e.g. {samples[:1]} "
    for key, what in (
        ("unmatched", "unmatched responses"),
        ("lost", "connections closed by the collector"),
        ("unacked", "requests unacked after the drain"),
    ):
        if count := sum(r.get(key, 0) for r in results):
            figure.note += f"{count} {what} "
    if figure.target_events_per_s and figure.events_per_s < 0.97 * figure.target_events_per_s:
        figure.note += (
            f"did not reach the paced rate ({fmt_number(figure.events_per_s)} of "
            f"{fmt_number(figure.target_events_per_s)} events/s) "
        )
    figure.note = figure.note.strip()
    return figure


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` shares as even as can be."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def websocket_case(
    run: Run,
    collector: Collector,
    connections: int,
    events_per_s: float = 0.0,
    *,
    during: Callable[[], None] | None = None,
    seconds: float | None = None,
) -> LoadFigure:
    load = f"paced {fmt_number(events_per_s / 1000)}k/s" if events_per_s else "closed"
    figure = LoadFigure("WebSocket", collector.ack, connections, load, collector.bus)
    figure.target_events_per_s = events_per_s or None
    span = seconds if seconds is not None else run.seconds
    shares = split(connections, max(1, min(run.args.generators, connections // 100 or 1)))
    generators = [
        spawn(
            role_command(
                "ws-load",
                port=collector.port,
                connections=share,
                index=i,
                warmup=run.warmup,
                duration=span,
                rate=events_per_s * share / connections,
                drain=15,
                max_seconds=span + run.warmup + 120,
            )
        )
        for i, share in enumerate(shares)
    ]
    drive(collector, generators, figure, run.warmup, span, during=during)
    report_progress(figure)
    return figure


def http_case(run: Run, collector: Collector, protocol: str) -> LoadFigure:
    figure = LoadFigure(protocol, collector.ack, HTTP_CONCURRENCY, "closed", collector.bus)
    generator = spawn(
        role_command(
            "rest-load" if protocol == "REST" else GRPC_ROLES[run.args.grpc_client],
            port=collector.port if protocol == "REST" else collector.grpc_port,
            connections=HTTP_CONCURRENCY,
            identity=RACCOON_IDENTITY if protocol == "gRPC" and collector.bus == RACCOON else None,
            warmup=min(1.0, run.warmup),
            duration=run.http_seconds,
            max_seconds=run.http_seconds + 120,
        )
    )
    drive(collector, [generator], figure, min(1.0, run.warmup), run.http_seconds)
    report_progress(figure)
    return figure


def report_progress(f: LoadFigure) -> None:
    threads = (
        ""
        if f.bus == RACCOON
        else f" (loop thread {f.loop_thread_cores:.2f}, of which GC {f.gc_loop_cores:.2f})"
    )
    progress(
        f"  {f.case}: {fmt_number(f.events_per_s)} events/s, p50/p95/p99 "
        f"{fmt_number(f.p50_ms)}/{fmt_number(f.p95_ms)}/{fmt_number(f.p99_ms)} ms, "
        f"{'Raccoon' if f.bus == RACCOON else 'collector'} {f.collector_cores:.2f} cores{threads}, "
        f"{fmt_number(f.collector_rss_mb)} MB; generator {f.generator_cores:.2f} cores "
        + ("" if f.bus == "embedded" else f"; broker {f.broker_cores:.2f} cores ")
        + f.note
    )


def idle_case(run: Run, max_seconds: float) -> IdleFigure:
    """A fresh durable collector; warm it up with a few connections, take its RSS, then hold
    ``run.idle_connections`` connections that each sent one batch, and take its RSS again."""
    figure = IdleFigure(wanted=run.idle_connections)
    collector = start_collector(run.directory, "durable", max_seconds)
    try:
        warm = spawn(
            role_command("ws-idle", port=collector.port, connections=50, index=9, max_seconds=60)
        )
        read_json(warm, 60)
        tell(warm, "stop")
        read_json(warm, 30)
        kill(warm)
        time.sleep(1.5)
        base = collector.sample()
        figure.baseline_mb, figure.baseline_pss_mb = base.rss_mb, base.pss_mb
        shares = split(run.idle_connections, len(IDLE_SOURCES))
        t0 = time.perf_counter()
        holders = [
            spawn(
                role_command(
                    "ws-idle",
                    port=collector.port,
                    connections=share,
                    index=i,
                    source=IDLE_SOURCES[i],
                    max_seconds=max_seconds,
                )
            )
            for i, share in enumerate(shares)
        ]
        try:
            ready = [read_json(h, max_seconds) for h in holders]
            figure.open_s = time.perf_counter() - t0
            figure.connections = sum(r["ready"] for r in ready)
            errors = sum(r["error_count"] for r in ready)
            unacked = sum(r["unacked"] for r in ready)
            if errors or unacked:
                samples = [e for r in ready for e in r["errors"] + r["batch_errors"]]
                figure.note = f"{errors} connect errors, {unacked} batches unacked {samples[:1]}"
            time.sleep(2)  # let the collector settle (finished tasks freed)
            held = collector.sample()
            figure.rss_mb, figure.pss_mb = held.rss_mb, held.pss_mb
            for h in holders:
                tell(h, "stop")
        finally:
            for h in holders:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.wait(15)
                kill(h)
    finally:
        stop_collector(collector)
    if n := figure.connections:

        def at_10k(before: float, held: float) -> float:  # extrapolated when fewer were held
            return (
                held if n == IDLE_CONNECTIONS else before + IDLE_CONNECTIONS * (held - before) / n
            )

        figure.per_connection_kb = (figure.rss_mb - figure.baseline_mb) / n * 1000
        figure.rss_at_10k_mb = at_10k(figure.baseline_mb, figure.rss_mb)
        figure.pss_at_10k_mb = at_10k(figure.baseline_pss_mb, figure.pss_mb)
    progress(
        f"  {figure.connections:,} idle connections: PSS {fmt_number(figure.baseline_pss_mb)} -> "
        f"{fmt_number(figure.pss_mb)} MB, RSS {fmt_number(figure.baseline_mb)} -> "
        f"{fmt_number(figure.rss_mb)} MB ({fmt_number(figure.per_connection_kb)} kB each) "
        f"{figure.note}"
    )
    return figure


def the_records() -> list[Any]:
    """The records the collector makes of one template request: the same decoder and record
    builder, with the context headers a WebSocket request gets."""
    from headwater.collector.config import LimitsConfig
    from headwater.collector.events import RequestContext, to_messages
    from headwater.collector.protocols import raccoon

    guid = "r" * GUID_LEN
    intake = raccoon.decode_request(with_guid(request_template(), guid.encode()), LimitsConfig())
    context = RequestContext(
        "raccoon-ws", "raccoon", guid, time.time_ns() // 1_000_000, HOST, "headwater-bench"
    )
    return to_messages(intake.events, context)


def raw_log_case(run: Run, partitions: int) -> RawFigure:
    """The same records appended straight to the embedded log (durability always) by 64
    asyncio appenders in this process: bench/bus.py's measurement."""
    import bus as bus_bench  # bench/bus.py
    from headwater.bus.embedded.backend import EmbeddedBus
    from headwater.bus.embedded.config import EmbeddedBusConfig

    records = the_records()
    size = sum(
        len(m.value) + len(m.key or b"") + sum(len(k) + len(v) for k, v in m.headers or ())
        for m in records
    ) // len(records)
    directory = run.directory / "raw-log"
    config = EmbeddedBusConfig(durability="always", default_partitions=partitions)
    try:
        with EmbeddedBus(directory, config) as bus:
            figure, _ = bus_bench.measure_appends(
                bus,
                policy="always",
                appenders=RAW_APPENDERS,
                mode="asyncio",
                partitions=partitions,
                seconds=min(run.seconds, 5.0),
                warmup=min(1.0, run.warmup),
                batch=records,
                disk_bytes=bus_bench.batch_disk_bytes(records),
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return RawFigure(
        figure.records_per_s,
        figure.latency_p50_ms,
        figure.latency_p99_ms,
        figure.process_cores,
        partitions,
        RAW_APPENDERS,
        figure.seconds,
        size,
    )


# -- profiling the collector under load ----------------------------------------------------------
# Stages of the collector's work, by the file (and function) of the frames on a sample's stack;
# a sample counts for the first stage (in this order) that any of its frames belongs to.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Raccoon protobuf decode", ("protocols/raccoon.py:decode_request", "_walk")),
    ("records + headers (to_messages, UUIDv7)", ("collector/events.py", "bus/headers.py")),
    ("record validation (validate_batch)", ("bus/validation.py",)),
    ("log: encode + queue (append_many)", ("bus/embedded/", "bus/partitioner.py")),
    ("response encode", ("ok_response_bytes", "error_response_bytes")),
    ("metrics", ("collector/metrics.py", "prometheus_client")),
    ("WebSocket send (aiohttp writer)", ("send_bytes", "send_frame", "_websocket/writer")),
    ("WebSocket receive + frame parsing (aiohttp)", ("_websocket/reader", "web_ws.py:receive")),
    ("collector glue (service, publisher, server)", ("collector/",)),
    ("aiohttp HTTP server (handshakes, requests)", ("aiohttp/",)),
    ("gRPC", ("grpc",)),
    ("asyncio / uvloop machinery", ("asyncio/", "uvloop", "<module>")),
)


def stage_shares(raw: str, thread_pid: int) -> list[tuple[str, float]]:
    """Shares of the samples of thread ``thread_pid`` by stage of the collector's work."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit() or not stack.startswith(f"thread ({thread_pid})"):
            continue
        count = int(count_text)
        total += count
        frames = [_frame_key(f) for f in stack.split(";")[1:]]
        for name, markers in STAGES:
            if any(m in f for f in frames for m in markers):
                counts[name] += count
                break
        else:
            counts["other (native: no Python frame, GC, ...)"] += count
    return [(name, n / total) for name, n in counts.most_common()] if total else []


def _frame_key(frame: str) -> str:
    """'name (path/file.py:12)' -> 'path/file.py:name' (to match stage markers)."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{path}:{name}"


def profile_collector(
    run: Run, collector: Collector, connections: int, py_spy: str | None
) -> ProfileFigure:
    """py-spy on the collector while ``connections`` WebSocket connections load it (closed
    loop): the share of time each thread was on the CPU and in what."""
    seconds = max(2, round(run.seconds / 2))
    figure = ProfileFigure(
        f"WebSocket {collector.ack} x{connections} closed", seconds, PY_SPY_RATE, float("nan")
    )
    if py_spy is None:
        figure.note = PY_SPY_MISSING
        progress(figure.note)
        return figure
    progress(f"profiling the collector with py-spy: {figure.case}, {seconds} s")
    raw: list[str] = []

    def sample() -> None:
        raw.append(py_spy_record_pid(py_spy, collector.pid, seconds, rate=PY_SPY_RATE))

    load = websocket_case(run, collector, connections, during=sample, seconds=seconds + 1)
    figure.events_per_s = load.events_per_s
    text = raw[0] if raw else ""
    if not text:
        figure.note = "py-spy could not sample the collector"
        return figure
    ticks = seconds * PY_SPY_RATE
    main = {collector.pid: "event loop (main thread)"}
    threads = parse_py_spy_raw(text, 16, main)
    figure.threads = [{**asdict(t), "busy": t.samples / ticks} for t in threads]
    figure.categories = stage_shares(text, collector.pid)
    return figure


# -- the run --------------------------------------------------------------------------------------
def note_background(run: Run) -> None:
    """How busy the machine is (cores, over 1 s) before the run starts anything (a note when
    it is)."""
    a = sample_process(os.getpid())
    time.sleep(1.0)
    b = sample_process(os.getpid())
    run.background_cores = machine_busy_between(a, b) * (os.cpu_count() or 1)
    progress(f"machine busy before the run: {run.background_cores:.2f} cores (of 2)")
    if run.background_cores > 0.3:
        run.notes.append(
            f"the machine was already busy with {run.background_cores:.2f} cores of other "
            "work when the run started: the figures are lower than on a quiet machine"
        )


def collector_seconds(run: Run) -> float:
    """How long a collector may live: its phase's cases, with room to spare."""
    phase_s = 20 + (run.warmup + run.seconds + 6) * (len(run.connections) + 3)
    return phase_s + 2 * (run.http_seconds + 10)


def measure(run: Run) -> None:
    args = run.args
    py_spy = find_py_spy()
    note_background(run)
    phase_s = collector_seconds(run)

    # (5) the raw log, first, while nothing else runs
    progress(f"raw log: the same records, {RAW_APPENDERS} asyncio appenders, durability always")
    run.raw = raw_log_case(run, partitions=PARTITIONS)  # as the collector's topic gets
    progress(f"  raw log: {fmt_number(run.raw.records_per_s)} records/s")

    # (1)-(3) durable: WebSocket, paced, REST, gRPC, then a profile when a target is missed
    collector = start_collector(run.directory, "durable", phase_s)
    try:
        run.loads += durable_cases(run, collector, paced=True)
        largest = run.connections[-1]
        missed = not all(t.passed for t in targets(run.loads, None))
        if args.profile == "always" or (args.profile == "auto" and missed):
            run.profiles.append(profile_collector(run, collector, largest, py_spy))
    finally:
        stop_collector(collector)

    # (4) idle connections
    progress(f"{run.idle_connections:,} idle WebSocket connections (one batch each)")
    run.idle = idle_case(run, 150)


def durable_cases(run: Run, collector: Collector, *, paced: bool) -> list[LoadFigure]:
    """WebSocket closed loop at each connection count, then (``paced``) at the target's rate
    over the largest, then REST and gRPC, on ``collector``."""
    loads = [websocket_case(run, collector, n) for n in run.connections]
    if paced:
        loads.append(websocket_case(run, collector, run.connections[-1], TARGET_PACED_EVENTS_S))
    return loads + [http_case(run, collector, protocol) for protocol in ("REST", "gRPC")]


def compare_buses(run: Run) -> None:
    """``--bus kafka``: the durable closed-loop cases on the embedded log, then the same on a
    fresh collector appending to an Apache Kafka broker (acks=all), started for them and
    stopped after."""
    note_background(run)
    for on_kafka in (False, True):
        cluster = kafka_broker(run.args.brokers) if on_kafka else contextlib.nullcontext()
        with cluster as broker:
            if broker is not None:
                CHILDREN.extend(n.process for n in broker.alive())  # the watchdog ends them
            collector = start_collector(
                run.directory, "durable", collector_seconds(run), kafka=broker
            )
            try:
                if broker is not None:
                    warm_up(run, collector)
                run.loads += durable_cases(run, collector, paced=False)
            finally:
                stop_collector(collector)
            if broker is not None:
                run.broker = broker_figures(broker)
                raccoon_cases(run, broker)  # on the same broker, before it stops


def jit_seconds(pids: Sequence[int]) -> float:
    """CPU seconds the JVMs ``pids`` have spent in their JIT compiler threads (Linux)."""
    return sum(
        cpu_s
        for pid in pids
        for name, cpu_s in sample_process(pid).threads.values()
        if "CompilerThre" in name
    )


def warm_up(run: Run, collector: Collector) -> None:
    """Fresh brokers' JVMs compile their hot paths under load for a long time (three of them on
    two cores: over a core for well over 20 s), which the first cases would pay and Raccoon's,
    measured later on the same brokers, would not. So rounds of WebSocket x100 for
    ``WARM_UP_S`` and x1 for half of it, not recorded, until the compiler threads take under
    ``JIT_SETTLED_CORES`` in a round (at most ``WARM_UP_MAX_S``)."""
    saved = run.seconds
    began = time.monotonic()
    try:
        while True:
            before, at = jit_seconds(collector.broker_pids), time.monotonic()
            run.seconds = WARM_UP_S
            websocket_case(run, collector, 100)
            run.seconds = WARM_UP_S / 2
            websocket_case(run, collector, 1)
            compiling = (jit_seconds(collector.broker_pids) - before) / (time.monotonic() - at)
            spent = time.monotonic() - began
            progress(
                f"warming the brokers up (not recorded): their JIT compilers at "
                f"{compiling:.2f} cores after {spent:.0f} s"
            )
            if compiling < JIT_SETTLED_CORES or spent > WARM_UP_MAX_S:
                return
    finally:
        run.seconds = saved


def broker_pids(kafka: KafkaCluster) -> tuple[int, ...]:
    return tuple(n.process.pid for n in kafka.alive())


def bus_comparison(loads: Sequence[LoadFigure]) -> list[dict[str, Any]]:
    """Each case measured on both buses: events/s on each, and the ratio Kafka / embedded."""
    on_kafka = {f.shape: f for f in loads if f.bus == "kafka"}
    return [
        {
            "case": e.shape,
            "embedded_events_per_s": e.events_per_s,
            "kafka_events_per_s": k.events_per_s,
            "kafka_over_embedded": (
                k.events_per_s / e.events_per_s if e.events_per_s > 0 else float("nan")
            ),
            "embedded_p95_ms": e.p95_ms,
            "kafka_p95_ms": k.p95_ms,
            "embedded_collector_cores": e.collector_cores,
            "kafka_collector_cores": k.collector_cores,
            "broker_cores": k.broker_cores,
        }
        for e in loads
        if e.bus == "embedded" and (k := on_kafka.get(e.shape)) is not None
    ]


# -- the peer: Raccoon v0.3.0 on the same broker (issue 37) ---------------------------------------
def default_raccoon() -> str | None:
    """``$HEADWATER_RACCOON``, else the usual build's path when it is there."""
    if path := os.environ.get("HEADWATER_RACCOON"):
        return path
    return str(RACCOON_DEFAULT) if RACCOON_DEFAULT.exists() else None


def raccoon_missing(peer: RaccoonRun) -> str:
    return (
        f"Raccoon not measured: {peer.reason}; build it ({RACCOON_DEFAULT} is where the bench "
        f"looks; elsewhere: --raccoon PATH or $HEADWATER_RACCOON): {RACCOON_BUILD}"
    )


def raccoon_cases(run: Run, kafka: KafkaCluster) -> None:
    """Raccoon on ``kafka``'s broker, under the durable closed-loop cases headwater ran on it:
    WebSocket at each connection count, REST, gRPC. A case it cannot run is skipped with why;
    without the binary, or when it does not start, the run goes on without it."""
    binary = run.args.raccoon
    peer = run.raccoon = RaccoonRun(binary)
    if not binary or not os.access(binary, os.X_OK) or not Path(binary).is_file():
        peer.reason = f"no Raccoon executable at {binary or RACCOON_DEFAULT}"
        progress(raccoon_missing(peer))
        return
    peer.found = True
    if not port_free(RACCOON_PPROF_PORT):
        peer.reason = (
            f"port {RACCOON_PPROF_PORT} is taken: Raccoon v0.3.0 binds its pprof server to "
            f"localhost:{RACCOON_PPROF_PORT}, which it cannot be told to move, and exits when "
            "it cannot"
        )
        progress(f"Raccoon not measured: {peer.reason}")
        return
    progress(f"Raccoon ({binary}) on the same broker")
    try:
        peer.topic = RACCOON_TOPIC_PATTERN % "click"
        create_topic(kafka, peer.topic, PARTITIONS)
        raccoon = start_raccoon(run.directory, Path(binary), kafka, peer)
    except (RuntimeError, OSError) as e:
        peer.reason = f"it did not start: {e}"
        progress(f"Raccoon not measured: {peer.reason}")
        return
    cases = [(f"WebSocket x{n}", partial(websocket_case, run, raccoon, n)) for n in run.connections]
    cases += [(p, partial(http_case, run, raccoon, p)) for p in ("REST", "gRPC")]
    try:
        for name, case in cases:
            if raccoon.proc.poll() is not None:
                peer.reason = f"Raccoon exited (code {raccoon.proc.returncode}) before {name}"
                progress(f"  {peer.reason}")
                break
            try:
                figure = case()
            except (RuntimeError, OSError, ValueError, KeyError, IndexError) as e:
                peer.skipped.append(f"{name}: the case failed: {e}")
                progress(f"  Raccoon {name} skipped: {e}")
                continue
            if not figure.events_per_s > 0:
                peer.skipped.append(f"{name}: nothing acked: {figure.note or 'no answer'}")
                progress(f"  Raccoon {name} skipped: nothing acked")
                continue
            run.loads.append(figure)
            peer.measured = True
    finally:
        stop_raccoon(raccoon, peer)


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def create_topic(kafka: KafkaCluster, topic: str, partitions: int) -> None:
    """``topic`` with ``partitions``, as headwater's topics get them, rather than left to the
    broker's auto-creation (``num.partitions`` 1) on Raccoon's first message."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    new = NewTopic(topic, num_partitions=partitions, replication_factor=min(3, len(kafka.nodes)))
    try:
        admin.create_topics([new], operation_timeout=30)[topic].result(60)
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise RuntimeError(f"creating topic {topic}: {e}") from None
    except TimeoutError:
        raise RuntimeError(f"creating topic {topic}: no answer within 60 s") from None


def start_raccoon(
    directory: Path, binary: Path, kafka: KafkaCluster, peer: RaccoonRun
) -> Collector:
    """``raccoon server`` on free ports, configured by its environment, its output in its log,
    in its own process group; killed when this process ends (``setpriv --pdeathsig``), by the
    watchdog, or by ``stop_raccoon``. Returned once a batch is acked."""
    data_dir = Path(tempfile.mkdtemp(prefix="raccoon-", dir=directory))  # its cwd: no config.yaml
    port = free_port(HOST)
    grpc_port = free_port(HOST)
    while grpc_port == port:
        grpc_port = free_port(HOST)
    peer.environment = {
        "SERVER_WEBSOCKET_PORT": str(port),
        "SERVER_GRPC_PORT": str(grpc_port),
        "SERVER_WEBSOCKET_CONN_ID_HEADER": "X-User-ID",
        "PUBLISHER_TYPE": "kafka",
        "PUBLISHER_KAFKA_CLIENT_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "EVENT_ACK": "1",
        "WORKER_POOL_SIZE": str(RACCOON_WORKERS),
        "EVENT_DISTRIBUTION_PUBLISHER_PATTERN": RACCOON_TOPIC_PATTERN,
    }
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **peer.environment}  # nothing else
    command = [str(binary), "server"]
    if setpriv := shutil.which("setpriv"):
        command = [setpriv, "--pdeathsig", "KILL", "--", *command]  # the same pid, exec'd
    log = open(data_dir / "raccoon.log", "w+b")  # noqa: SIM115 (closed in stop_raccoon)
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=data_dir,
        env=env,
        start_new_session=True,
    )
    CHILDREN.append(proc)  # the watchdog ends it too
    raccoon = Collector(
        proc, "durable", port, grpc_port, log, data_dir, RACCOON, broker_pids(kafka)
    )
    try:
        peer.ready_s = wait_raccoon(raccoon, RACCOON_START_S)
    except RuntimeError as e:
        log.seek(0)
        tail = log.read().decode(errors="replace")[-600:]
        stop_raccoon(raccoon, peer)
        raise RuntimeError(f"{e}; its log ends: {tail}") from None
    log.seek(0)
    found = re.search(r'msg="Raccoon ([^"]*)"', log.read().decode(errors="replace"))
    peer.version = found.group(1).strip() if found else ""
    progress(
        f"Raccoon {peer.version or '(its build logs no version)'} pid {proc.pid} on port {port}, "
        f"gRPC {grpc_port}, topic {peer.topic}: a batch acked {peer.ready_s:.1f} s after start"
    )
    return raccoon


def wait_raccoon(raccoon: Collector, timeout_s: float) -> float:
    """Until ``GET /ping`` answers, the gRPC port accepts and a REST batch is acked (the way to
    Kafka works): the seconds it took."""
    started = time.monotonic()
    template = request_template()
    problem = "nothing yet"
    while time.monotonic() - started < timeout_s:
        if raccoon.proc.poll() is not None:
            raise RuntimeError(f"Raccoon exited (code {raccoon.proc.returncode})")
        try:
            status, body = http_exchange(raccoon.port, "GET", "/ping", b"", {})
            if status != 200:
                problem = f"/ping: HTTP {status} {body[:80]!r}"
            else:
                socket.create_connection((HOST, raccoon.grpc_port), 5).close()
                guid = Guids("bench-probe-").next()
                headers = {"Content-Type": "application/proto", "X-User-ID": "bench-probe"}
                body_out = with_guid(template, guid)
                status, body = http_exchange(raccoon.port, "POST", PATH, body_out, headers)
                problem = reply_problem(body, guid) or ("" if status == 200 else f"HTTP {status}")
                if not problem:
                    time.sleep(0.5)  # a service that failed to bind (pprof) ends it by now
                    if raccoon.proc.poll() is None:
                        return time.monotonic() - started
                    problem = "exited after its first batch"
        except (OSError, http.client.HTTPException) as e:
            problem = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    raise RuntimeError(f"Raccoon not ready within {timeout_s:.0f} s: {problem}")


def http_exchange(
    port: int, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


# logrus's text lines (a message quoted when it needs to be) and librdkafka's own
LOG_LINE = re.compile(r'level=(warning|error|fatal|panic) msg=(?:"((?:[^"\\]|\\.)*)"|(\S+))')
RDKAFKA_LINE = re.compile(r"^%(\d)\|[\d.]+\|([^|]+)\|[^|]*\|\s*(.*)$")
# numbers inside a token (connection ids, addresses, ports), masked to count alike messages
# together; a number on its own (a close code) is kept
IN_TOKEN_NUMBER = re.compile(r"(?<=[A-Za-z.:/-])\d+|\d++(?=[A-Za-z.:/-])")


def stop_raccoon(raccoon: Collector, peer: RaccoonRun) -> None:
    """SIGTERM (it closes its servers and flushes its producer), then SIGKILL; what its log said
    goes into ``peer``."""
    end_child(raccoon.proc, "Raccoon", 15.0)
    raccoon.log.seek(0)
    read_raccoon_log(raccoon.log.read().decode(errors="replace"), peer)
    raccoon.log.close()
    shutil.rmtree(raccoon.data_dir, ignore_errors=True)


def read_raccoon_log(text: str, peer: RaccoonRun) -> None:
    """Its errors and warnings (logrus lines, librdkafka's, the client events its publisher
    prints, a Go panic), counted by message with the ids and addresses in it masked."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if found := LOG_LINE.search(line):
            level, message = found.group(1), found.group(2) or found.group(3)
        elif found := RDKAFKA_LINE.match(line):
            severity, tag, message = found.groups()
            if int(severity) > 4:
                continue
            level, message = ("error" if int(severity) <= 3 else "warning"), f"{tag}: {message}"
        elif line.startswith(("panic:", "fatal error:")):
            level, message = "panic", line
        elif line.startswith("Ignored "):  # a librdkafka event its publisher printed and dropped
            level, message = "warning", line
        else:
            continue
        if level != "warning":
            peer.log_errors += 1
        counts[f"{level}: {IN_TOKEN_NUMBER.sub('#', message)[:160]}"] += 1
    peer.log_messages = counts.most_common(6)


def raccoon_comparison(loads: Sequence[LoadFigure]) -> list[dict[str, Any]]:
    """Each case measured on headwater on Kafka and on Raccoon: events/s and the ratio
    headwater / Raccoon, p99s, collector CPU per event, the broker's cores."""
    on_kafka = {f.shape: f for f in loads if f.bus == "kafka"}
    return [
        {
            "case": r.shape,
            "headwater_events_per_s": h.events_per_s,
            "raccoon_events_per_s": r.events_per_s,
            "headwater_over_raccoon": (
                h.events_per_s / r.events_per_s if r.events_per_s > 0 else float("nan")
            ),
            "headwater_p99_ms": h.p99_ms,
            "raccoon_p99_ms": r.p99_ms,
            "headwater_us_per_event": h.collector_us_per_event,
            "raccoon_us_per_event": r.collector_us_per_event,
            "headwater_rss_mb": h.collector_rss_mb,
            "raccoon_rss_mb": r.collector_rss_mb,
            "headwater_broker_cores": h.broker_cores,
            "raccoon_broker_cores": r.broker_cores,
        }
        for r in loads
        if r.bus == RACCOON and (h := on_kafka.get(r.shape)) is not None
    ]


def raccoon_targets(
    loads: Sequence[LoadFigure], peer: RaccoonRun | None, brokers: int = 1
) -> list[Target]:
    """Issue 37's targets for headwater on Kafka (closed loop, ack: durable); on three
    brokers, the same within 25% (``CLUSTER_SLACK``)."""
    slack = CLUSTER_SLACK if brokers >= 3 else 1.0
    where = "" if brokers == 1 else f", {brokers} brokers (targets within 25%)"

    def closed(bus: str, protocol: str, connections: int) -> LoadFigure | None:
        return next(
            (
                f
                for f in loads
                if f.bus == bus
                and f.protocol == protocol
                and f.connections == connections
                and f.load == "closed"
            ),
            None,
        )

    nan = float("nan")
    ws100, ws1 = closed("kafka", "WebSocket", 100), closed("kafka", "WebSocket", 1)
    theirs = closed(RACCOON, "WebSocket", 100)
    ratio, detail = nan, "Raccoon not measured"
    if peer is not None and peer.reason and theirs is None:
        detail += f": {peer.reason}"
    if ws100 is not None and theirs is not None and theirs.events_per_s > 0:
        ratio = ws100.events_per_s / theirs.events_per_s
        detail = (
            f"headwater {fmt_number(ws100.events_per_s)} vs Raccoon "
            f"{fmt_number(theirs.events_per_s)} events/s, same broker, same load"
        )
    return [
        Target(
            f"WebSocket x100 events/s on Kafka / Raccoon v0.3.0's{where}",
            ratio,
            TARGET_OVER_RACCOON * (2 - slack),
            "x",
            detail,
        ),
        Target(
            f"p99 ack latency, WebSocket x100 on Kafka{where}",
            ws100.p99_ms if ws100 else nan,
            TARGET_KAFKA_P99_MS * slack,
            "ms",
            "closed loop, 4 requests in flight per connection",
            higher_is_better=False,
        ),
        Target(
            f"collector CPU per event, WebSocket x100 on Kafka{where}",
            ws100.collector_us_per_event if ws100 else nan,
            TARGET_KAFKA_US_PER_EVENT * slack,
            "us",
            "all the collector's processes and threads",
            higher_is_better=False,
        ),
        Target(
            f"WebSocket x1 events/s on Kafka{where}",
            ws1.events_per_s if ws1 else nan,
            TARGET_KAFKA_WS1_EVENTS_S * (2 - slack),
            "events/s",
            "closed loop, 4 requests in flight",
        ),
    ]


def targets(loads: Sequence[LoadFigure], idle: IdleFigure | None) -> list[Target]:
    """Issue 14's targets on the embedded log's durable figures."""
    out: list[Target] = []
    durable = [f for f in loads if f.ack == "durable" and f.bus == "embedded"]
    for f in durable:
        if f.load != "closed":
            continue
        if f.protocol == "WebSocket" and f.connections in (1, 100):
            out.append(
                Target(
                    f"WebSocket x{f.connections} events/s, ack: durable",
                    f.events_per_s,
                    TARGET_EVENTS_S,
                    "events/s",
                    "closed loop, 4 requests in flight per connection",
                )
            )
        elif f.protocol in ("REST", "gRPC"):
            out.append(
                Target(
                    f"{f.protocol} x{f.connections} events/s, ack: durable",
                    f.events_per_s,
                    TARGET_HTTP_EVENTS_S,
                    "events/s",
                    "closed loop",
                )
            )
    for f in durable:
        if f.target_events_per_s == TARGET_PACED_EVENTS_S:
            where = "" if f.connections == 1000 else " (the target names 1,000 connections)"
            out.append(
                Target(
                    f"p95 ack latency at {f.connections:,} connections, paced at 100k events/s",
                    f.p95_ms,
                    TARGET_P95_MS,
                    "ms",
                    f"{fmt_number(f.events_per_s)} events/s achieved of the 100k/s paced{where}",
                    higher_is_better=False,
                )
            )
    if idle is not None:
        extrapolated = idle.connections != IDLE_CONNECTIONS
        out.append(
            Target(
                "memory of the whole collector (PSS of all its processes), 10k idle connections",
                idle.pss_at_10k_mb,
                TARGET_IDLE_RSS_MB,
                "MB",
                f"{idle.connections:,} connections measured"
                + (", extrapolated to 10k" if extrapolated else "")
                + f"; RSS summed over the processes: {fmt_number(idle.rss_at_10k_mb)} MB",
                higher_is_better=False,
            )
        )
    return out


# -- output ---------------------------------------------------------------------------------------
LOAD_COLUMNS = (  # (header, LoadFigure attribute)
    ("case", "case"),
    ("events/s", "events_per_s"),
    ("p50 ms", "p50_ms"),
    ("p95 ms", "p95_ms"),
    ("p99 ms", "p99_ms"),
    ("errors", "errors"),
    ("collector cores", "collector_cores"),
    ("loop thread", "loop_thread_cores"),
    ("GC in loop", "gc_loop_cores"),
    ("full GC/s", "full_gcs_per_s"),
    ("us CPU/event", "collector_us_per_event"),
    ("RSS MB", "collector_rss_mb"),
    ("generator cores", "generator_cores"),
    ("machine cores", "machine_cores"),
)


def report(run: Run, markdown: bool = False) -> str:
    out = [
        machine_line(machine_info(run.directory)),
        f"workload: Raccoon SendEventRequest of {EVENTS_PER_BATCH} events x {EVENT_BYTES} B "
        f"({len(request_template()):,} B), a new req_guid each; WebSocket: at most {IN_FLIGHT} "
        f"in flight per connection; {run.seconds:g} s per case after {run.warmup:g} s warm-up "
        f"(REST/gRPC {run.http_seconds:g} s, {HTTP_CONCURRENCY} concurrent; gRPC on one HTTP/2 "
        f"connection from the {run.args.grpc_client} client)",
        "LOAD GENERATOR ON THE SAME 2-CORE MACHINE: the collector, the load generator processes "
        "(their CPU is the 'generator cores' column) and the kernel's loopback TCP share 2 cores; "
        "'machine cores' is everything that was busy.",
        f"machine busy before the run started: {run.background_cores:.2f} cores",
        run.steal.line(),
        *[f"note: {n}" for n in run.notes],
        "",
        "loads (closed: every connection keeps 4 requests in flight, the next sent on each ack; "
        "paced: a fixed total rate; latency = send to ack at the client; collector cores = all "
        "its threads, loop thread = its event-loop thread alone):",
    ]
    rows = [[getattr(f, name) for _, name in LOAD_COLUMNS] for f in run.loads]
    out.append(print_table([h for h, _ in LOAD_COLUMNS], rows, markdown=markdown))
    out += [f"  {f.case}: {f.note}" for f in run.loads if f.note]
    if run.broker is not None:
        out += ["", *comparison_lines(run.broker, run.loads, markdown)]
    if run.raccoon is not None:
        out += ["", *raccoon_lines(run.raccoon, run.loads, markdown)]
    if run.raw is not None:
        raw = run.raw
        durable = [
            f
            for f in run.loads
            if f.ack == "durable" and f.protocol == "WebSocket" and f.load == "closed"
        ]
        out += [
            "",
            f"raw log, same run, same records ({raw.record_bytes} B each with the collector's "
            f"context headers), EmbeddedBus in-process, durability always, {raw.appenders} "
            f"asyncio appenders, {raw.partitions} partitions: "
            f"{fmt_number(raw.records_per_s)} records/s, append p50 {fmt_number(raw.p50_ms)} "
            f"ms, p99 {fmt_number(raw.p99_ms)} ms, {raw.cores:.2f} cores",
        ]
        out += [
            f"  collector / raw log, WebSocket durable x{f.connections}: "
            f"{f.events_per_s / raw.records_per_s:.2f}"
            for f in durable
        ]
    if run.idle is not None:
        i = run.idle
        out += [
            "",
            f"idle connections (fresh durable collector, each connection sent one batch and got "
            f"its ack; opened in {fmt_number(i.open_s)} s from {len(IDLE_SOURCES)} processes): "
            f"{i.connections:,} of {i.wanted:,} open; all the collector's processes: PSS "
            f"{fmt_number(i.baseline_pss_mb)} MB before, {fmt_number(i.pss_mb)} MB with them "
            f"({fmt_number(i.pss_at_10k_mb)} MB at 10k); RSS summed "
            f"{fmt_number(i.baseline_mb)} MB before, {fmt_number(i.rss_mb)} MB with them: "
            f"{fmt_number(i.per_connection_kb)} kB per connection, "
            f"{fmt_number(i.rss_at_10k_mb)} MB at 10k {i.note}",
        ]
    out += ["", "targets:"]
    out += [f"  {t.verdict()}" for t in run.targets]
    for p in run.profiles:
        out += ["", *profile_lines(p)]
    return "\n".join(out)


def comparison_lines(
    broker: dict[str, Any], loads: Sequence[LoadFigure], markdown: bool
) -> list[str]:
    """The table of the cases measured on both buses, under what the broker was."""
    peak = broker["peak_rss_bytes"]
    headers = ["case (ack: durable)", "embedded events/s", "Kafka events/s", "Kafka / embedded"]
    headers += ["embedded p95 ms", "Kafka p95 ms", "collector cores, embedded"]
    headers += ["collector cores, Kafka", "broker cores"]
    rows: list[list[object]] = [
        [_ratio(v) if k == "kafka_over_embedded" else v for k, v in c.items()]
        for c in bus_comparison(loads)
    ]
    return [
        f"embedded log (durability always) vs Kafka (acks=all), same run, same cases: Apache "
        f"Kafka {broker['kafka_version']}, {broker['brokers']} broker (KRaft) on loopback, JVM "
        f"{' '.join(broker['jvm_options'])}, sharing the 2 cores (broker cores), peak RSS "
        + ("-" if peak is None else f"{fmt_number(peak / MB)} MB")
        + ":",
        print_table(headers, rows, markdown=markdown),
    ]


def raccoon_lines(peer: RaccoonRun, loads: Sequence[LoadFigure], markdown: bool) -> list[str]:
    """The table of the cases measured on headwater on Kafka and on Raccoon, or why Raccoon was
    not measured; the cases it skipped, what its log said."""
    if not peer.found:
        return [raccoon_missing(peer)]
    rows: list[list[object]] = [
        [_ratio(v) if k == "headwater_over_raccoon" else v for k, v in c.items()]
        for c in raccoon_comparison(loads)
    ]
    if not rows:
        out = [f"Raccoon not measured: {peer.reason or 'no case ran'}"]
    else:
        headers = ["case (ack: durable)", "headwater events/s", "Raccoon events/s"]
        headers += ["headwater / Raccoon", "headwater p99 ms", "Raccoon p99 ms"]
        headers += ["headwater us CPU/event", "Raccoon us CPU/event", "headwater RSS MB"]
        headers += ["Raccoon RSS MB", "broker cores, headwater", "broker cores, Raccoon"]
        out = [
            f"headwater on Kafka vs Raccoon {peer.version or '(its build logs no version)'} at "
            f"{peer.binary}, on "
            "the same broker, same load, same run: Raccoon one Go process (CPU: all its "
            "threads), EVENT_ACK=1 (acked after Kafka's delivery report, librdkafka acks=all), "
            f"{RACCOON_WORKERS} publishing workers, topic {peer.topic} of {peer.partitions} "
            f"partitions created beforehand; a first batch acked {peer.ready_s:.1f} s after its "
            "start:",
            print_table(headers, rows, markdown=markdown),
        ]
        if peer.reason:
            out.append(f"  {peer.reason}")
    out += [f"  Raccoon {s}" for s in peer.skipped]
    out.append(
        f"  Raccoon's log: {peer.log_errors} error lines" + (":" if peer.log_messages else "")
    )
    out += [f"    {n:,}x {message}" for message, n in peer.log_messages]
    return out


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def profile_lines(p: ProfileFigure) -> list[str]:
    out = [
        f"where the time goes: {p.case}, py-spy (samples of threads on the CPU), {p.seconds} s "
        f"at {p.rate} Hz, {fmt_number(p.events_per_s)} events/s while sampling"
    ]
    if p.note:
        out.append(f"  {p.note}")
    if p.categories:
        out.append("  event-loop thread, share of its CPU samples by stage of the work:")
        out += [f"    {share:6.1%}  {name}" for name, share in p.categories]
    for t in p.threads:
        if t["busy"] < 0.03:
            continue
        out.append(f"  thread {t['thread']}: on the CPU {t['busy']:.0%} of the time")
        out.append("    innermost frames:")
        out += [f"      {n / t['samples']:6.1%}  {fn}" for fn, n in t["leaves"][:8]]
        out.append("    on the stack (inclusive):")
        out += [f"      {n / t['samples']:6.1%}  {fn}" for fn, n in t["inclusive"][:12]]
    return out


def to_json(run: Run) -> dict[str, Any]:
    return {
        **run_facts(run.directory),
        "background_cores_before": run.background_cores,
        "steal_share": run.steal.share(),
        "workload": {
            "events_per_request": EVENTS_PER_BATCH,
            "event_bytes": EVENT_BYTES,
            "request_bytes": len(request_template()),
            "in_flight_per_connection": IN_FLIGHT,
            "seconds": run.seconds,
            "warmup_s": run.warmup,
            "http_seconds": run.http_seconds,
            "http_concurrency": HTTP_CONCURRENCY,
        },
        "loads": [{**asdict(f), "case": f.case} for f in run.loads],
        "raw_log": asdict(run.raw) if run.raw else None,
        "idle": asdict(run.idle) if run.idle else None,
        "targets": [t.as_json() for t in run.targets],
        "profiles": [asdict(p) for p in run.profiles],
        "notes": run.notes,
        **(
            {"kafka_broker": run.broker, "bus_comparison": bus_comparison(run.loads)}
            if run.broker is not None
            else {}
        ),
        **(
            {"raccoon": asdict(run.raccoon), "raccoon_comparison": raccoon_comparison(run.loads)}
            if run.raccoon is not None
            else {}
        ),
    }


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__, quick="a smoke run, under 60 s", profile="the collector under load")
    parser.add_argument(
        "--seconds", type=float, default=None, help="WebSocket window (default 10, --quick 3)"
    )
    parser.add_argument(
        "--generators",
        type=int,
        default=1,
        help="WebSocket load generator processes for 100+ connections (default 1)",
    )
    parser.add_argument(
        "--bus",
        choices=("embedded", "kafka"),
        default="embedded",
        help="kafka: the durable closed-loop cases on an Apache Kafka broker (acks=all) and, in "
        "the same run, on the embedded log and on Raccoon (--raccoon) on the same broker, "
        "compared (nothing else)",
    )
    parser.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="with --bus kafka, Kafka brokers to start (3: replication 3, min.insync.replicas "
        "2, for headwater's topic and Raccoon's)",
    )
    parser.add_argument(
        "--raccoon",
        metavar="PATH",
        default=default_raccoon(),
        help="with --bus kafka, the Raccoon v0.3.0 executable to measure on the same broker "
        f"(default $HEADWATER_RACCOON, else {RACCOON_DEFAULT} if it exists)",
    )
    parser.add_argument(
        "--grpc-client",
        choices=tuple(GRPC_ROLES),
        default="raw",
        help="the gRPC load's client: a hand-written HTTP/2 client sending pre-built frames "
        "(raw, default, like the WebSocket and REST loads) or grpc.aio's own (aio)",
    )
    # internal: the child processes' roles
    parser.add_argument(
        "--role",
        choices=("collector", "ws-load", "ws-idle", "rest-load", "grpc-load", "grpc-aio-load"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--identity", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--drain", type=float, default=15, help=argparse.SUPPRESS)
    parser.add_argument("--max-seconds", type=float, default=300, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def guard(max_seconds: float, stop: Callable[[], None]) -> None:
    """Raise the open-file limit, and ``stop`` this child after ``max_seconds`` or when the
    benchmark that started it is gone: it never outlives the run."""
    raise_fd_limit()
    parent = os.getppid()

    def watch() -> None:
        deadline = time.monotonic() + max_seconds
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.5)
        stop()

    threading.Thread(target=watch, name="bench-guard", daemon=True).start()


def run_role(args: argparse.Namespace) -> int:
    if args.role == "collector":
        role_collector(args)
        return 0
    guard(args.max_seconds, lambda: os._exit(4))
    roles = {
        "ws-load": role_ws_load,
        "ws-idle": role_ws_idle,
        "rest-load": role_rest_load,
        "grpc-load": role_grpc_load,
        "grpc-aio-load": role_grpc_aio_load,
    }
    main_coroutine = roles[args.role](args)
    if args.role == "grpc-aio-load":
        asyncio.run(main_coroutine)  # grpc.aio on the default event loop
    else:
        import uvloop

        uvloop.run(main_coroutine)
    sys.stdout.flush()
    os._exit(0)  # the stdin reader thread may still be blocked


def watchdog(limit_s: float) -> None:
    """End the whole run (children first) after ``limit_s`` seconds, whatever happens."""

    def expire() -> None:
        progress(f"hard time limit of {limit_s:.0f} s reached: stopping everything")
        for proc in CHILDREN:
            kill(proc)
        os._exit(3)

    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    timer.start()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        return run_role(args)
    seconds = args.seconds if args.seconds is not None else (3.0 if args.quick else 10.0)
    started = time.perf_counter()
    kafka = args.bus == "kafka"
    if kafka:
        from headwater.testing.kafka import broker_jars

        broker_jars()  # fetched from Maven Central the first time: not under the time limit
    peer_s = (60 if args.quick else 120) if kafka and args.raccoon else 0  # Raccoon's cases
    watchdog((110 if args.quick else 330) + (60 if kafka else 0) + peer_s)  # a broker to start
    fds = raise_fd_limit()
    if fds < IDLE_CONNECTIONS + 2_000:
        progress(f"open-file limit {fds}: too low for {IDLE_CONNECTIONS:,} idle connections")
    try:
        with scratch_directory(args.dir, "bench-collector-", keep=args.keep) as directory:
            run = Run(
                args=args,
                directory=directory,
                warmup=1.0 if args.quick else 2.0,
                seconds=seconds,
                http_seconds=2.0 if args.quick else 5.0,
                connections=(1, 100) if args.quick else (1, 100, 1000),
                idle_connections=2_000 if args.quick else IDLE_CONNECTIONS,
            )
            progress(f"benchmark directory {directory}")
            if kafka:
                compare_buses(run)
            else:
                measure(run)
            run.targets += targets(run.loads, run.idle)
            if kafka:
                run.targets += raccoon_targets(run.loads, run.raccoon, run.args.brokers)
    finally:
        for proc in CHILDREN:
            if proc.poll() is None:
                kill(proc)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    output(args.format, lambda: to_json(run), lambda markdown: report(run, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
