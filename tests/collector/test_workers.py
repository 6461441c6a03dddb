"""``headwater collector`` with its intake in two forked worker processes (``collector.workers:
2``): both serve the one port, the limit per identity and the metrics hold across them, acks
stay durable, a killed worker is replaced, and neither SIGTERM nor SIGKILL of the main process
leaves a worker behind or loses an acked event. Which worker serves a connection is read from
/proc (the worker whose file descriptors hold the server side of that TCP connection)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import struct
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from headwater.bus import open_bus
from headwater.collector.protocols import raccoon
from headwater.config.loader import load_config
from headwater.testing import clients
from headwater.testing.clients import OP_BINARY, RawWebSocket, raccoon_request, raccoon_response
from headwater.testing.collector import CollectorProcess
from headwater.testing.kafka import KafkaCluster
from headwater.testing.load.grpc import SEND_EVENT, GrpcConnection
from headwater.testing.load.http1 import HttpConnection
from headwater.testing.proc_tree import tree_pids
from headwater.testing.waiting import until, wait_until

HOST = "127.0.0.1"
WORKERS = 2
TYPE = "wk"
TOPIC = "clickstream-wk-log"
ANSWER_S = 10.0  # a live collector answers well within this
EXIT_S = 30.0  # for processes to start, stop or be replaced
EMBEDDED = "  embedded:\n    durability: always\n"
COLLECTOR = """\
collector:
  workers: 2
  share_grpc_calls: always
  ack: durable
  admission:
    min_free_disk_bytes: null
  raccoon:
    max_connections_per_identity: 1
"""
SUCCESS, LIMITED = raccoon.Status.SUCCESS, raccoon.Code.MAX_USER_LIMIT_REACHED


def write_config(tmp_path: Path, bus: str = EMBEDDED) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(f"data_dir: {tmp_path / 'state'}\nbus:\n{bus}{COLLECTOR}")
    return path


# -- processes, and which one serves a connection -------------------------------------------


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie left for its parent to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Running:
    process: CollectorProcess
    port: int
    seen: set[int]  # every worker pid seen

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def workers(self) -> list[int]:
        """The live worker processes (the main process's children)."""
        pids = sorted(p for p in tree_pids(self.pid) if p != self.pid and alive(p))
        self.seen.update(pids)
        return pids

    def serving(self, client_port: int) -> int:
        """The worker holding the server side of the connection from ``client_port``: the one
        with a file descriptor on its socket (by inode, from /proc/net/tcp)."""
        ports = (f"{self.port:04X}", f"{client_port:04X}")

        def find() -> int | None:
            with open("/proc/net/tcp") as f:
                rows = [line.split() for line in list(f)[1:]]
            inodes = [r[9] for r in rows if r[3] == "01" and (r[1][-4:], r[2][-4:]) == ports]
            socket = f"socket:[{inodes[0]}]" if inodes else None
            return next((p for p in self.workers() if socket in fd_targets(p)), None)

        return wait_until(find, f"a worker holds the connection from :{client_port}", ANSWER_S)


@contextmanager
def start(config_file: Path, name: str = "collector") -> Iterator[Running]:
    process = CollectorProcess(config_file, config_file.parent / f"{name}.err")
    seen: set[int] = set()
    try:
        running = Running(process, process.wait_healthy(), seen)
        wait_until(lambda: len(running.workers()) == WORKERS, "both workers run", EXIT_S)
        yield running
    finally:
        process.close()
        for pid in seen:  # (only after a failure: none outlives the main process)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def fd_targets(pid: int) -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


# -- clients --------------------------------------------------------------------------------


async def http_open(port: int) -> HttpConnection:
    return await HttpConnection.open(HOST, port, timeout=ANSWER_S, event_type=TYPE)


async def per_worker(c: Running, each: int) -> dict[int, list[HttpConnection]]:
    """At least ``each`` open HTTP connections served by every worker (the kernel spreads new
    connections by a hash of their addresses: a few more than needed get there)."""
    by_worker: dict[int, list[HttpConnection]] = {pid: [] for pid in c.workers()}
    for _ in range(64):
        if all(len(conns) >= each for conns in by_worker.values()):
            return by_worker
        conn = await http_open(c.port)
        await conn.request("GET", "/healthz")  # (accepted by now)
        by_worker[c.serving(conn.port)].append(conn)
    raise AssertionError(f"64 connections, none to some worker: {by_worker}")


async def post_all(
    conns: list[HttpConnection], batches: list[tuple[str, list[bytes]]], event_type: str = TYPE
) -> bool:
    """Post ``batches`` spread over ``conns`` (one after another on each); True: all acked."""

    async def one(k: int) -> bool:
        return all([await conns[k].post(*b, event_type) for b in batches[k :: len(conns)]])

    return all(await asyncio.gather(*(one(k) for k in range(len(conns)))))


async def ws_connect(port: int, identity: str) -> RawWebSocket:
    return await RawWebSocket.connect(HOST, port, headers={"X-User-ID": identity})


def client_port(ws: RawWebSocket) -> int:
    port: int = ws.writer.get_extra_info("sockname")[1]
    return port


async def ws_send(ws: RawWebSocket, guid: str, value: bytes) -> Any:
    """Send one batch; the connection's next answer (a refusal comes first, unasked)."""
    ws.send_frame(OP_BINARY, raccoon_request(guid, [(TYPE, value)]))
    frame = await ws.recv_data(ANSWER_S)
    assert frame is not None and frame.opcode == OP_BINARY, frame
    return raccoon_response(frame.payload)


async def ws_close(ws: RawWebSocket) -> None:
    with contextlib.suppress(ConnectionError):
        ws.send_frame(clients.OP_CLOSE, struct.pack("!H", 1000))
    await ws.close()


async def attempt(c: Running, identity: str) -> tuple[Any, int, RawWebSocket]:
    """A WebSocket connection for ``identity`` with one batch sent: the first answer (an ack
    or a refusal), the worker serving it, and the connection (still open)."""
    ws = await ws_connect(c.port, identity)
    response = await ws_send(ws, f"{identity}-{uuid.uuid4().hex[:8]}", b"x")
    return response, c.serving(client_port(ws)), ws


async def refused_by_both(c: Running, identity: str, n: int) -> None:
    """``identity`` holds its one connection: ``n`` more, all refused, by both workers."""
    tries = await asyncio.gather(*(attempt(c, identity) for _ in range(n)))
    for _, _, ws in tries:
        await ws_close(ws)
    assert [r.code for r, _, _ in tries] == [LIMITED] * n
    assert {pid for _, pid, _ in tries} == set(c.workers()), "both workers refused some"


async def accepted_soon(c: Running, identity: str) -> None:
    """Try until a connection for ``identity`` is accepted (a release reaches the main process
    a little after the close that made it)."""
    deadline = time.monotonic() + ANSWER_S
    while True:
        response, _, ws = await attempt(c, identity)
        await ws_close(ws)
        if response.status == SUCCESS:
            return
        assert response.code == LIMITED and time.monotonic() < deadline, response
        await asyncio.sleep(0.02)


def sample(metrics: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def stored(config_file: Path, topic: str = TOPIC) -> list[bytes]:
    """Every record value of ``topic`` (read-only: beside a running collector too)."""
    bus = open_bus(load_config(config_file, env={}), read_only=True)
    try:
        if topic not in {t.name for t in bus.topics()}:
            return []
        out: list[bytes] = []
        for partition in range(bus.topic(topic).partitions):
            offset, high = bus.watermarks(topic, partition)
            while offset < high:
                records = bus.read(topic, partition, offset, max_records=5000)
                out += [r.value for r in records]
                offset += len(records)
        return out
    finally:
        bus.close()


# -- load -----------------------------------------------------------------------------------


@dataclass
class Ledger:
    """Batches sent (one event each, its value the batch's id) and which were acked."""

    sent: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    answered: int = 0

    def send(self, ws: RawWebSocket, guid: str) -> None:
        self.sent.add(guid)
        ws.send_frame(OP_BINARY, raccoon_request(guid, [(TYPE, guid.encode())]))

    def answer(self, payload: bytes) -> bool:
        """Note a WebSocket answer; True: an ack."""
        self.answered += 1
        response = raccoon_response(payload)
        if response.status == SUCCESS:
            self.acked.add(response.data["req_guid"])
        return bool(response.status == SUCCESS)

    def missing(self, values: list[bytes]) -> list[str]:
        return sorted(self.acked - {v.decode() for v in values})


async def ws_load(port: int, name: str, ledger: Ledger, in_flight: int = 8) -> None:
    """Keep ``in_flight`` requests outstanding on one connection until the server closes it
    (after a refusal, only wait for the outstanding answers)."""
    ws = await ws_connect(port, name)
    outstanding, n, refused = 0, 0, False
    try:
        while True:
            while not refused and outstanding < in_flight:
                ledger.send(ws, f"{name}-{n}")
                n, outstanding = n + 1, outstanding + 1
            frame = await ws.recv_data(ANSWER_S)
            if frame is None or frame.opcode != OP_BINARY:
                return
            outstanding -= 1
            refused = not ledger.answer(frame.payload)
    except ConnectionError:
        return
    finally:
        await ws.close()


async def load_then_signal(c: Running, ledger: Ledger, sig: signal.Signals) -> tuple[int, int]:
    """WebSocket load on 4 connections, ``sig`` to the main process once 100 batches are
    acked; back when the server has closed every connection. The batches in flight at the
    signal, and those answered before it."""
    loads = [asyncio.create_task(ws_load(c.port, f"load-{i}", ledger)) for i in range(4)]
    await until(
        lambda: len(ledger.acked) >= 100 or any(t.done() for t in loads), "100 acks", EXIT_S
    )
    assert not any(t.done() for t in loads), await asyncio.gather(*loads)
    answered = ledger.answered
    c.process.proc.send_signal(sig)
    await asyncio.wait_for(asyncio.gather(*loads), EXIT_S)
    return len(ledger.sent) - answered, answered


async def rest_load(port: int, name: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """One batch after another, each on a new connection, until ``stop``; a batch whose
    connection fails (reset, no answer) is sent again; every batch must be acked."""
    n = 0
    while not stop.is_set():
        guid, acked = f"{name}-{n}", False
        n += 1
        ledger.sent.add(guid)
        for _ in range(5):
            with contextlib.suppress(OSError):
                conn = await http_open(port)
                try:
                    acked = await conn.post(guid, [guid.encode()])
                finally:
                    await conn.close()
                break
        assert acked, f"{guid} was not acked"
        ledger.acked.add(guid)


# -- the tests ------------------------------------------------------------------------------


def test_both_workers_serve_and_every_ack_is_durable(tmp_path: Path) -> None:
    async def scenario(c: Running) -> tuple[list[Any], Counter[int], str]:
        sockets = [await ws_connect(c.port, f"user-{i}") for i in range(40)]
        responses = await asyncio.gather(
            *(ws_send(ws, f"b-{i}", b"e-%d" % i) for i, ws in enumerate(sockets))
        )
        owners = Counter(c.serving(client_port(ws)) for ws in sockets)
        http = await http_open(c.port)
        metrics = await http.metrics()
        await http.close()
        for ws in sockets:
            await ws_close(ws)
        return responses, owners, metrics

    config_file = write_config(tmp_path)
    with start(config_file) as c:
        responses, owners, metrics = asyncio.run(scenario(c))
        values = stored(config_file)
    assert [r.status for r in responses] == [SUCCESS] * 40
    assert len(owners) == WORKERS and sum(owners.values()) == 40, owners
    assert sample(metrics, "headwater_collector_connections") == 40
    assert sorted(values) == sorted(b"e-%d" % i for i in range(40))


def test_one_grpc_connections_calls_are_served_by_both_workers(tmp_path: Path) -> None:
    """A connection lives in one worker, but its calls in flight are shared with the other
    (``collector.sharing``): every call answered as its own, every event durable once."""
    calls, per_call = 200, 5
    sent = {i: [b"g-%d-%d" % (i, j) for j in range(per_call)] for i in range(calls)}

    async def scenario(c: Running, grpc_port: int) -> tuple[dict[int, Any], str]:
        loop = asyncio.get_running_loop()
        replies: dict[int, Any] = {}
        all_in = loop.create_future()

        def on_reply(token: int, reply: bytes | None, problem: str) -> None:
            replies[token] = raccoon_response(reply) if reply is not None else problem
            if len(replies) == calls:
                all_in.set_result(None)

        _, conn = await loop.create_connection(
            lambda: GrpcConnection(f"{HOST}:{grpc_port}", SEND_EVENT, on_reply), HOST, grpc_port
        )
        await asyncio.wait_for(conn.ready, ANSWER_S)
        for i, values in sent.items():
            conn.call(raccoon_request(f"g-{i}", [(TYPE, v) for v in values]), i)
        await asyncio.wait_for(all_in, 60)
        conn.close()
        http = await http_open(c.port)
        metrics = await http.metrics()
        await http.close()
        return replies, metrics

    config_file = write_config(tmp_path)
    with start(config_file) as c:
        line = c.process.wait_for_line("headwater: gRPC EventService on ")
        grpc_port = int(line.split()[4].rsplit(":", 1)[1])
        replies, metrics = asyncio.run(scenario(c, grpc_port))
        values = stored(config_file)
    for i in range(calls):
        assert not isinstance(replies[i], str), replies[i]
        assert (replies[i].status, replies[i].data["req_guid"]) == (SUCCESS, f"g-{i}")
    assert sorted(values) == sorted(v for vs in sent.values() for v in vs)
    shared = "headwater_collector_grpc_calls_shared_total"
    handed = sample(metrics, shared, way="handed")
    assert handed and handed == sample(metrics, shared, way="taken"), metrics
    assert not sample(metrics, shared, way="declined")


def test_connection_limit_per_identity_holds_across_workers(tmp_path: Path) -> None:
    async def scenario(c: Running) -> None:
        first = await ws_connect(c.port, "u1")
        assert (await ws_send(first, "first", b"1")).status == SUCCESS
        await refused_by_both(c, "u1", 24)
        # concurrent first connections of a new identity, through both workers: one counts
        racing = await asyncio.gather(*(attempt(c, "u2") for _ in range(24)))
        for _, _, ws in racing:
            await ws_close(ws)
        assert sorted(r.status == SUCCESS for r, _, _ in racing) == [False] * 23 + [True]
        assert len({pid for _, pid, _ in racing}) == WORKERS
        await ws_close(first)  # (the release reaches the main process through its worker)
        await accepted_soon(c, "u1")

    with start(write_config(tmp_path)) as c:
        asyncio.run(scenario(c))


def test_metrics_are_summed_over_workers(tmp_path: Path) -> None:
    batches, events = 30, 4

    async def scenario(c: Running) -> list[str]:
        by_worker = await per_worker(c, 3)
        conns = [conn for group in by_worker.values() for conn in group]
        sent = [(f"m-{i}", [b"m-%d-%d" % (i, j) for j in range(events)]) for i in range(batches)]
        assert await post_all(conns, sent)
        scrapes = [await group[0].metrics() for group in by_worker.values()]
        for conn in conns:
            await conn.close()
        return scrapes

    config_file = write_config(tmp_path)
    with start(config_file) as c:
        scrapes = asyncio.run(scenario(c))
        assert len(stored(config_file)) == batches * events
    for metrics in scrapes:  # the same sums, whichever worker answers
        published = sample(metrics, "headwater_collector_events_published_total", type=TYPE)
        received = sample(
            metrics, "headwater_collector_events_received_total", type=TYPE, protocol="raccoon-rest"
        )
        assert published == received == batches * events


def test_a_killed_worker_is_replaced(tmp_path: Path) -> None:
    ledger = Ledger()

    async def scenario(c: Running) -> int:
        held = await ws_connect(c.port, "held")  # the victim: the worker serving this one
        victim = c.serving(client_port(held))
        stop = asyncio.Event()
        loads = [asyncio.create_task(rest_load(c.port, f"r{i}", ledger, stop)) for i in range(3)]
        going = lambda n: len(ledger.acked) >= n or any(t.done() for t in loads)  # noqa: E731
        await until(lambda: going(30), "30 acks before the kill", EXIT_S)
        for i in range(8):
            ledger.send(held, f"held-{i}")
        await held.drain()
        os.kill(victim, signal.SIGKILL)  # with those 8 in flight
        at_kill = len(ledger.acked)
        while (frame := await held.recv_data(ANSWER_S)) is not None and frame.opcode == OP_BINARY:
            ledger.answer(frame.payload)
        await held.close()
        await until(
            lambda: len(p := c.workers()) == WORKERS and victim not in p, "a new worker", EXIT_S
        )
        await accepted_soon(c, "held")  # the dead worker's connections were released
        await until(lambda: going(at_kill + 60), "60 acks after the kill", EXIT_S)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loads), EXIT_S)  # (raises what failed)
        for pid, conns in (await per_worker(c, 1)).items():  # the new worker serves too
            assert await conns[0].post(f"after-{pid}", [b"after-%d" % pid]), pid
            for conn in conns:
                await conn.close()
        return victim

    config_file = write_config(tmp_path)
    with start(config_file) as c:
        before = c.workers()
        victim = asyncio.run(scenario(c))
        after = c.workers()
        exited = f"(pid {victim}) exited with code -9; starting another"
        wait_until(lambda: exited in c.process.stderr(), "the restart in stderr", ANSWER_S)
        assert alive(c.pid) and "Traceback" not in c.process.stderr(), c.process.stderr()
        assert victim in before and victim not in after and len(set(after) - set(before)) == 1
        missing = ledger.missing(stored(config_file))
    assert not missing, f"acked but not on the log: {missing[:10]}"


def test_sigterm_finishes_in_flight_requests_and_stops_every_worker(tmp_path: Path) -> None:
    ledger = Ledger()
    config_file = write_config(tmp_path)
    with start(config_file) as c:
        workers = c.workers()
        in_flight, answered = asyncio.run(load_then_signal(c, ledger, signal.SIGTERM))
        assert c.process.proc.wait(EXIT_S) == 0, c.process.stderr()
        c.process.wait_for_line("headwater: stopped")
        assert not [pid for pid in workers if alive(pid)], "a worker outlived the main process"
        assert "did not stop in time" not in c.process.stderr()
        assert "Traceback" not in c.process.stderr(), c.process.stderr()
    assert in_flight > 0 and ledger.answered > answered, "requests in flight were answered"
    missing = ledger.missing(stored(config_file))
    assert not missing, f"acked but not on the log: {missing[:10]}"


def test_workers_die_with_the_main_process(tmp_path: Path) -> None:
    ledger = Ledger()
    config_file = write_config(tmp_path)
    with start(config_file) as c:
        workers = c.workers()
        asyncio.run(load_then_signal(c, ledger, signal.SIGKILL))
        assert c.process.proc.wait(EXIT_S) == -signal.SIGKILL
        gone = lambda: not any(alive(pid) for pid in workers)  # noqa: E731
        wait_until(gone, "the workers to die with the main process", EXIT_S)
    with start(config_file, "restarted"):
        missing = ledger.missing(stored(config_file))
    assert len(ledger.acked) >= 100
    assert not missing, f"acked but not on the log: {missing[:10]}"


@pytest.mark.kafka
def test_workers_on_kafka(tmp_path: Path, kafka_broker: KafkaCluster) -> None:
    event_type = f"wk-{uuid.uuid4().hex[:10]}"  # (the broker is shared: a topic of this test's)
    kafka = (
        f"  backend: kafka\n  kafka:\n    bootstrap_servers: '{kafka_broker.bootstrap_servers}'\n"
    )
    config_file = write_config(tmp_path, kafka + "    timeout_s: 15\n")
    sent = [b"k-%d-%d" % (i, j) for i in range(20) for j in range(3)]

    async def scenario(c: Running) -> None:
        by_worker = await per_worker(c, 2)
        conns = [conn for group in by_worker.values() for conn in group]
        batches = [(f"k-{i}", sent[3 * i : 3 * i + 3]) for i in range(20)]
        assert await post_all(conns, batches, event_type)
        for conn in conns:
            await conn.close()
        first = await ws_connect(c.port, "u1")
        await refused_by_both(c, "u1", 24)
        await ws_close(first)

    with start(config_file) as c:
        asyncio.run(scenario(c))
    assert sorted(stored(config_file, f"clickstream-{event_type}-log")) == sorted(sent)
