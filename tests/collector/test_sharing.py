"""gRPC calls shared between intake workers (``collector.sharing``), in one process: two
workers' links to a real ``LogHost`` (``collector.host``) over Unix socket pairs, each link with
a ``CallSharing`` whose handle is the test's (it answers with the name of the worker that served
the call, so each answer says where the call went)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import pytest

from headwater.collector.host import LogHost
from headwater.collector.limits import Connections
from headwater.collector.link import Link
from headwater.collector.metrics import Metrics
from headwater.collector.sharing import CallSharing, HandedCallFailed
from headwater.testing.waiting import until

CALLS = 40


@dataclass
class Worker:
    name: str
    link: Link
    metrics: Metrics
    sharing: CallSharing
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


async def worker(host: LogHost, index: int, name: str) -> Worker:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host.attach(index, ours)
    link = await Link.connect(theirs, list)
    metrics = Metrics()
    made = Worker(name, link, metrics, None)  # type: ignore[arg-type]
    made.sharing = CallSharing(made.handle, link, metrics)
    link.ready()
    return made


@contextlib.asynccontextmanager
async def workers(count: int = 2) -> AsyncIterator[list[Worker]]:
    host = LogHost(None, Connections(10, 10))
    made = [await worker(host, i, "ab"[i]) for i in range(count)]
    try:
        await until(lambda: host.all_ready(count), "the workers ready")
        yield made
    finally:
        for w in made:
            w.release.set()
            w.link.close()
        host.close()


async def call(w: Worker, n: int) -> bytes:
    return await w.sharing(b"call-%d" % n, {"x-user-id": "u1"}, "10.0.0.7")


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
            assert a.sharing.serving == b.sharing.serving == a.sharing.handed == 0

    asyncio.run(run())


def test_one_call_at_a_time_is_never_handed() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            a.release.set()
            for n in range(10):
                assert (await call(a, n)).startswith(b"a:")
            assert b.started == 0 and a.count("handed") == 0

    asyncio.run(run())


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

    asyncio.run(run())


def test_without_a_sibling_a_handed_call_is_declined_by_the_host() -> None:
    async def run() -> None:
        async with workers(1) as (a,):
            calls = [asyncio.ensure_future(call(a, n)) for n in range(3)]
            await until(lambda: a.started == 3, "every call served here")
            a.release.set()
            assert all(x.startswith(b"a:") for x in await asyncio.gather(*calls))
            assert a.count("declined") >= 1

    asyncio.run(run())


def test_a_call_the_sibling_fails_fails_with_its_reason() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            b.fail = True
            first = asyncio.ensure_future(call(a, 0))
            await until(lambda: a.started == 1, "the first call started here")
            second = asyncio.ensure_future(call(a, 1))
            await until(lambda: b.started == 1, "the second call handed")
            b.release.set()
            with pytest.raises(HandedCallFailed, match=r"b cannot serve b'call-1'"):
                await second
            a.release.set()
            assert (await first).startswith(b"a:")
            assert b.sharing.serving == 0

    asyncio.run(run())


def test_a_sibling_that_goes_away_fails_the_calls_it_held_and_no_call_hangs() -> None:
    async def run() -> None:
        async with workers() as (a, b):
            first = asyncio.ensure_future(call(a, 0))
            await until(lambda: a.started == 1, "the first call started here")
            second = asyncio.ensure_future(call(a, 1))
            await until(lambda: b.started == 1, "the second call handed")
            b.link.close()  # the sibling's process is gone, its call unanswered
            with pytest.raises(HandedCallFailed, match="went away"):
                await asyncio.wait_for(second, 10)
            a.release.set()
            assert (await first).startswith(b"a:")
            third = asyncio.ensure_future(call(a, 2))  # no sibling now: declined, served here
            fourth = asyncio.ensure_future(call(a, 3))
            assert all(x.startswith(b"a:") for x in await asyncio.gather(third, fourth))

    asyncio.run(run())
