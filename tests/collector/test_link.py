"""An intake worker's link to the log (``collector.link`` with ``collector.host`` and a real
embedded log, in one process): an append's body stays in the shared ring until the log has
written it, even when the request that made it is cancelled first; the single-batch appends of
one turn of the loop go to the log as one merged batch per topic and partition, each append
answered with its own records' offsets, in the order they were made."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.embedded.partition import Partition
from headwater.bus.errors import BusUnavailable
from headwater.bus.records import Message
from headwater.collector import link as link_module
from headwater.collector.host import LogHost
from headwater.collector.limits import Connections
from headwater.collector.link import Link, LinkClosed
from headwater.collector.ring import Ring, shared_mapping
from headwater.testing.waiting import until

TOPIC = "t"


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    with EmbeddedBus(tmp_path / "log", EmbeddedBusConfig(default_partitions=1)) as b:
        b.create_topic(TOPIC)
        yield b


class HeldWriter:
    """Holds the log's writer inside its first ``Partition.write`` until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = Partition.write
        first = [True]

        def write(partition: Partition, batches: list[fmt.EncodedBatch]) -> list[int]:
            if first[0]:
                first[0] = False
                self.entered.set()
                self.release.wait(30)
            return real(partition, batches)

        monkeypatch.setattr(Partition, "write", write)


def batch(value: bytes) -> fmt.EncodedBatch:
    return fmt.encode([Message(value) for _ in range(10)], 1_700_000_000_000)


@contextlib.asynccontextmanager
async def held_append(
    bus: EmbeddedBus, held: HeldWriter, value: bytes
) -> AsyncIterator[tuple[Link, Ring, asyncio.Future[list[int]]]]:
    """A link to ``bus`` with one append of ``value`` that the log's writer holds; the link and
    its host are closed (and the writer let go) at the end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mapping = shared_mapping(1 << 20)
    host = LogHost(bus, Connections(10, 10))
    host.attach(0, ours, mapping)
    ring = Ring(mapping)
    link = await Link.connect(theirs, list, ring)
    try:
        future = link.append([(TOPIC, 0, batch(value))])
        assert await asyncio.to_thread(held.entered.wait, 10)  # the log is writing it
        yield link, ring, future
    finally:
        held.release.set()
        link.close()
        host.close()


def test_a_cancelled_append_keeps_its_ring_region_until_the_log_has_written_it(
    bus: EmbeddedBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWriter(monkeypatch)

    async def scenario() -> None:
        async with held_append(bus, held, b"first" * 40) as (link, ring, future):
            future.cancel()  # as when the request waiting for it is cancelled
            await asyncio.sleep(0)
            # the region is still taken: the ring neither gives its pages back (which would
            # zero the body) nor hands the space to another append
            assert not ring.release_if_idle()
            assert link.pending_bytes > 0
            held.release.set()
            await until(
                lambda: link.pending_bytes == 0, "the link is drained"
            )  # answered: now it is free
            assert ring.release_if_idle()
            second = await link.append([(TOPIC, 0, batch(b"second" * 40))])
            assert second == [10]

    asyncio.run(scenario())
    values = [r.value for r in bus.read(TOPIC, 0, 0, max_records=100)]
    assert values == [b"first" * 40] * 10 + [b"second" * 40] * 10


def test_a_lost_link_fails_the_appends_waiting_and_frees_their_regions(
    bus: EmbeddedBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWriter(monkeypatch)

    async def scenario() -> None:
        async with held_append(bus, held, b"x" * 100) as (link, ring, future):
            assert link._transport is not None
            link._transport.abort()  # the process holding the log is gone
            with pytest.raises(LinkClosed):
                await asyncio.wait_for(future, 10)
            assert link.pending_bytes == 0
            assert ring.release_if_idle()
            with pytest.raises(BusUnavailable):
                link.append([(TOPIC, 0, batch(b"y"))])

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def linked(bus: EmbeddedBus, ring_bytes: int = 1 << 20) -> AsyncIterator[tuple[Link, Ring]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mapping = shared_mapping(ring_bytes)
    host = LogHost(bus, Connections(10, 10))
    host.attach(0, ours, mapping)
    ring = Ring(mapping)
    link = await Link.connect(theirs, list, ring)
    try:
        yield link, ring
    finally:
        link.close()
        host.close()


def log_batches(bus: EmbeddedBus, topic: str, partition: int) -> list[tuple[int, int]]:
    """(base offset, records) of each batch in a partition's log."""
    p = bus._topics[topic][partition]
    seg = p.segments[-1]
    return [(h.base_offset, h.count) for _, h, _, _ in seg.batches(0, seg.size, verify=True)]


@pytest.mark.parametrize("ring_bytes", [1 << 20, 64], ids=["in-the-ring", "inline"])
def test_a_turns_appends_to_one_partition_are_one_batch_each_answered_at_its_records(
    bus: EmbeddedBus, ring_bytes: int
) -> None:
    """Merged into the worker's ring, or sent inline in the frame when the ring has no room."""
    bus.create_topic("other", 2)

    async def scenario() -> list[list[int]]:
        async with linked(bus, ring_bytes) as (link, ring):
            futures = [link.append([(TOPIC, 0, batch(b"%d" % i))]) for i in range(5)]
            futures.append(link.append([("other", 1, batch(b"o"))]))
            futures.append(link.append([(TOPIC, 0, batch(b"5"))]))
            # a request over two topics goes as it is, after what the turn merged before it
            futures.append(link.append([(TOPIC, 0, batch(b"6")), ("other", 1, batch(b"p"))]))
            futures.append(link.append([(TOPIC, 0, batch(b"7"))]))
            answers = list(await asyncio.gather(*futures))
            await until(lambda: link.pending_bytes == 0, "the link is drained")
            # every region is free again (the small ring never held one: all went inline)
            assert ring.release_if_idle() == (ring_bytes > 64)
            return answers

    answers = asyncio.run(scenario())
    assert answers == [[0], [10], [20], [30], [40], [0], [50], [60, 10], [70]]
    assert log_batches(bus, TOPIC, 0) == [(0, 60), (60, 10), (70, 10)]
    assert log_batches(bus, "other", 1) == [(0, 10), (10, 10)]
    values = [r.value for r in bus.read(TOPIC, 0, 0, max_records=100)]
    assert values == [b"%d" % i for i in range(8) for _ in range(10)]


def test_a_merged_batch_is_sent_once_it_reaches_merge_bytes(
    bus: EmbeddedBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = len(batch(b"x" * 100).body)
    monkeypatch.setattr(link_module, "MERGE_BYTES", 3 * one)

    async def scenario() -> list[list[int]]:
        async with linked(bus) as (link, _):
            futures = [link.append([(TOPIC, 0, batch(b"x" * 100))]) for _ in range(7)]
            return list(await asyncio.gather(*futures))

    assert asyncio.run(scenario()) == [[i * 10] for i in range(7)]
    assert log_batches(bus, TOPIC, 0) == [(0, 30), (30, 30), (60, 10)]


def test_a_cancelled_append_in_a_merged_batch_leaves_the_others_answered(
    bus: EmbeddedBus,
) -> None:
    async def scenario() -> list[list[int]]:
        async with linked(bus) as (link, _):
            futures = [link.append([(TOPIC, 0, batch(b"%d" % i))]) for i in range(3)]
            futures[1].cancel()  # its records are queued all the same: the others still count
            answers = [await futures[0], await futures[2]]
            await until(lambda: link.pending_bytes == 0, "the link is drained")
            return answers

    assert asyncio.run(scenario()) == [[0], [20]]
    assert log_batches(bus, TOPIC, 0) == [(0, 30)]


def test_a_link_lost_before_its_turn_ends_fails_the_appends_it_was_merging(
    bus: EmbeddedBus,
) -> None:
    async def scenario() -> None:
        async with linked(bus) as (link, _):
            futures = [link.append([(TOPIC, 0, batch(b"%d" % i))]) for i in range(3)]
            assert link._transport is not None
            link._transport.abort()
            for future in futures:
                with pytest.raises(LinkClosed):
                    await asyncio.wait_for(future, 10)
            assert link.pending_bytes == 0

    asyncio.run(scenario())
    assert bus.read(TOPIC, 0, 0, max_records=100) == []
