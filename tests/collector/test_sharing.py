"""gRPC calls shared between intake workers (``collector.sharing``), in one process: two or three
``CallSharing``s over their real Unix sockets, each with the test's handle (it answers with the
name of the worker that served the call, so each answer says where the call went). A process
that is not a sibling is refused, tested with a real child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvloop

from headwater.collector import wire
from headwater.collector.metrics import Metrics
from headwater.collector.sharing import CallSharing, HandedCallFailed, Siblings, SpareCpu
from headwater.testing.waiting import until

CALLS = 40


@dataclass
class Worker:
    name: str
    metrics: Metrics = field(default_factory=Metrics)
    sharing: CallSharing = None  # type: ignore[assignment]  # (set at once)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # set: calls are answered
    served: list[bytes] = field(default_factory=list)
    started: int = 0
    fail: bool = False

    async def handle(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        self.started += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError(f"{self.name} cannot serve {message!r}")
        self.served.append(message)
        return f"{self.name}:{metadata['x-user-id']}:{peer}:".encode() + message

    def count(self, way: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "headwater_collector_grpc_calls_shared_total", {"way": way}
        )
        return value or 0.0

    def connected(self, siblings: int) -> bool:
        return len(self.sharing._peers) == siblings


@contextlib.asynccontextmanager
async def workers(count: int = 2, started: int | None = None) -> AsyncIterator[list[Worker]]:
    """``count`` workers' sharing, of which the first ``started`` (all) listen and connect."""
    group = uuid.uuid4().hex
    made = []
    for i in range(count):
        w = Worker("abc"[i])
        w.sharing = CallSharing(w.handle, w.metrics, Siblings(i, count, group))
        made.append(w)
    live = made[: count if started is None else started]
    # (start waits to reach every sibling: with some not started, it is left waiting)
    starting = [asyncio.ensure_future(w.sharing.start()) for w in live]
    try:
        for w in live:
            await until(lambda w=w: w.connected(len(live) - 1), "the workers connected")
        yield made
    finally:
        for task in starting:
            task.cancel()
        for w in made:
            w.release.set()
            w.sharing.disconnect()


async def call(w: Worker, n: int) -> bytes:
    return await w.sharing(b"call-%d" % n, {"x-user-id": "u1"}, "10.0.0.7")


async def one_here_one_handed(
    a: Worker, b: Worker
) -> tuple[asyncio.Future[bytes], asyncio.Future[bytes]]:
    """Two calls on ``a``: the first served there, the second handed to ``b`` (both held)."""
    first = asyncio.ensure_future(call(a, 0))
    await until(lambda: a.started == 1, "the first call started here")
    second = asyncio.ensure_future(call(a, 1))
    await until(lambda: b.started == 1, "the second call handed")
    return first, second


def test_calls_in_flight_are_spread_over_both_workers() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            calls = [asyncio.ensure_future(call(a, n)) for n in range(CALLS)]
            await until(lambda: a.started + b.started == CALLS, "every call started")
            assert a.started >= CALLS // 2 - 1 and b.started >= CALLS // 2 - 1
            a.release.set()
            b.release.set()
            answers = await asyncio.gather(*calls)
            for n, answer in enumerate(answers):  # each its own answer, from where it went
                assert answer.endswith(b":u1:10.0.0.7:call-%d" % n)
            by_b = [x for x in answers if x.startswith(b"b:")]
            assert len(by_b) == len(b.served) == b.started
            assert sorted(a.served + b.served) == sorted(b"call-%d" % n for n in range(CALLS))
            assert a.count("handed") == b.count("taken") == len(by_b)
            assert a.sharing.serving == b.sharing.serving == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_calls_go_to_the_least_busy_of_several_siblings() -> None:
    async def run() -> None:
        async with workers(3) as (a, b, c):
            calls = [asyncio.ensure_future(call(a, n)) for n in range(30)]
            await until(lambda: a.started + b.started + c.started == 30, "every call started")
            assert min(a.started, b.started, c.started) >= 8, (a.started, b.started, c.started)
            for w in (a, b, c):
                w.release.set()
            assert len(await asyncio.gather(*calls)) == 30

    uvloop.run(run())  # (the loop intake workers run)


def test_one_call_at_a_time_is_never_handed() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            a.release.set()
            for n in range(10):
                assert (await call(a, n)).startswith(b"a:")
            assert b.started == 0 and a.count("handed") == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_a_stopping_sibling_declines_and_the_call_is_served_here() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            await b.sharing.close(1.0)
            first = asyncio.ensure_future(call(a, 0))
            await until(lambda: a.started == 1, "the first call started here")
            second = asyncio.ensure_future(call(a, 1))  # handed, declined, served here
            await until(lambda: a.started == 2, "the declined call served here")
            a.release.set()
            assert [await first, await second] == [b"a:u1:10.0.0.7:call-0", b"a:u1:10.0.0.7:call-1"]
            assert b.started == 0 and a.count("declined") == 1 and a.count("handed") == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_a_stopping_worker_finishes_what_it_took_before_it_answers_no_more() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            first, second = await one_here_one_handed(a, b)
            closing = asyncio.ensure_future(b.sharing.close(10.0))
            await until(lambda: not b.sharing._taking, "b closing")
            assert not closing.done()  # waiting for the call it took
            b.release.set()
            await closing
            assert await second == b"b:u1:10.0.0.7:call-1"
            a.release.set()
            assert (await first).startswith(b"a:")

    uvloop.run(run())  # (the loop intake workers run)


def test_without_a_sibling_every_call_is_served_here() -> None:
    async def run() -> None:
        async with workers(2, started=1) as (a, _):
            calls = [asyncio.ensure_future(call(a, n)) for n in range(3)]
            await until(lambda: a.started == 3, "every call served here")
            a.release.set()
            assert all(x.startswith(b"a:") for x in await asyncio.gather(*calls))
            assert a.count("handed") == a.count("declined") == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_a_sibling_started_later_is_connected_to() -> None:
    async def run() -> None:
        async with workers(2, started=1) as (a, b):
            await b.sharing.start()
            await until(lambda: a.connected(1) and b.connected(1), "connected once b listens")

    uvloop.run(run())  # (the loop intake workers run)


def test_a_call_the_sibling_fails_fails_with_its_reason() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            b.fail = True
            first, second = await one_here_one_handed(a, b)
            b.release.set()
            with pytest.raises(HandedCallFailed, match=r"b cannot serve b'call-1'"):
                await second
            a.release.set()
            assert (await first).startswith(b"a:")
            assert b.sharing.serving == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_a_sibling_that_goes_away_fails_the_calls_it_held_and_no_call_hangs() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            first, second = await one_here_one_handed(a, b)
            b.sharing.disconnect()  # as when its process dies: its sockets close
            with pytest.raises(HandedCallFailed, match="went away"):
                await asyncio.wait_for(second, 10)
            a.release.set()
            assert (await first).startswith(b"a:")
            third = asyncio.ensure_future(call(a, 2))  # no sibling now: served here
            fourth = asyncio.ensure_future(call(a, 3))
            assert all(x.startswith(b"a:") for x in await asyncio.gather(third, fourth))

    uvloop.run(run())  # (the loop intake workers run)


NOT_A_SIBLING = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
s.settimeout(10)
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    print("answered" if s.recv(100) else "closed")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
"""


def test_a_process_that_is_not_a_sibling_is_refused() -> None:
    """Its parent is this test's process, not the workers' parent: closed, nothing served."""

    async def run() -> None:
        async with workers() as (_, b):
            hand = wire.frame(wire.HAND, 1, *wire.call_payload(b"x", {"x-user-id": "u"}, "p"))
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                NOT_A_SIBLING,
                b.sharing.siblings.address(1)[1:],  # (abstract: a NUL first)
                hand.hex(),
                stdout=subprocess.PIPE,
            )
            out, _ = await asyncio.wait_for(child.communicate(), 30)
            assert out.decode().strip() == "closed"
            assert b.started == 0 and b.count("taken") == 0

    uvloop.run(run())  # (the loop intake workers run)


def test_calls_are_handed_only_while_the_machine_has_a_spare_core(tmp_path: Path) -> None:
    """``share_grpc_calls: auto``: idle time from /proc/stat's first line (here a file the test
    writes), on at 0.4 of a core idle, off below 0.1, in between as it was."""
    stat = tmp_path / "stat"

    def write(idle: int, busy: int) -> None:  # jiffies: user nice system idle iowait ...
        stat.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 ...\n")

    write(0, 0)
    spare = SpareCpu(str(stat))
    cores = os.cpu_count() or 1
    steps = [(0.05, False), (0.3, False), (0.5, True), (0.2, True), (0.09, False)]
    idle = busy = 0
    for idle_cores, expected in steps:
        idle += round(1000 * idle_cores / cores)
        busy += 1000 - round(1000 * idle_cores / cores)
        write(idle, busy)
        spare._next = 0.0  # (the window is over)
        assert spare() is expected, (idle_cores, spare.idle_cores)

    async def run() -> None:
        async with workers() as (a, b):
            a.sharing._spare = lambda: False
            calls = [asyncio.ensure_future(call(a, n)) for n in range(6)]
            await until(lambda: a.started == 6, "every call served here")
            a.sharing._spare = lambda: True
            calls += [asyncio.ensure_future(call(a, n)) for n in range(6, 12)]
            await until(lambda: b.started == 6, "the next ones handed")
            a.release.set()
            b.release.set()
            assert len(await asyncio.gather(*calls)) == 12

    uvloop.run(run())
