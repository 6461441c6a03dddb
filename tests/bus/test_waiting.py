"""Appends that wait on a full write queue (``headwater.bus.waiting``), on both backends.

Each test opens the bus with a write queue small enough to fill in a moment: the embedded log's
``max_pending_bytes``, or the Kafka producer's buffer (``buffer_bytes``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from headwater.bus import Bus, Message, Position
from headwater.bus.errors import QueueFull
from headwater.bus.waiting import append_many_waiting, append_waiting

BATCHES = 200
PER_BATCH = 50


def small_queue(backend: str) -> dict[str, Any]:
    """Settings of ``backend``'s section that make its write queue hold about three batches."""
    if backend == "embedded":
        return {"durability": "always", "max_pending_bytes": 3 * PER_BATCH * 120}
    return {"buffer_bytes": 3 * PER_BATCH * 140}  # a record's bytes, as the producer counts


def batch(n: int) -> list[Message]:
    return [
        Message(f'{{"batch": {n}, "i": {i}, "pad": "{"x" * 80}"}}'.encode())
        for i in range(PER_BATCH)
    ]


def stored_values(bus: Bus, topic: str) -> list[bytes]:
    values: list[bytes] = []
    for p in range(bus.topic(topic).partitions):
        low, high = bus.watermarks(topic, p)
        offset = low
        while offset < high:
            records = bus.read(topic, p, offset, max_records=1000)
            values += [r.value for r in records]
            offset = records[-1].offset + 1
    return values


def test_plain_appends_meet_the_full_queue(
    backend: str, open_buses: Callable[..., Bus], unique: Callable[[str], str]
) -> None:
    """Without waiting, the small queue refuses appends, and a refused one stores nothing."""
    bus = open_buses(**small_queue(backend))
    topic = unique("plain")
    bus.create_topic(topic, partitions=2)
    accepted: list[Future[Any]] = []
    refused = 0
    for n in range(BATCHES):
        try:
            accepted.append(bus.append(topic, batch(n)))
        except QueueFull as e:
            assert e.code == "HW-BUS-101" and e.transient and e.needed > 0
            refused += 1
    for f in accepted:
        f.result(timeout=60)
    bus.flush()
    assert refused > 0, "the queue never filled: the test shows nothing"
    assert len(stored_values(bus, topic)) == len(accepted) * PER_BATCH


def test_append_waiting_stores_every_batch_once_in_order(
    backend: str, open_buses: Callable[..., Bus], unique: Callable[[str], str]
) -> None:
    bus = open_buses(**small_queue(backend))
    topic = unique("waiting")
    bus.create_topic(topic, partitions=2)
    futures = [append_waiting(bus, topic, batch(n)) for n in range(BATCHES)]
    positions: list[Position] = []
    for f in futures:
        positions += f.result(timeout=60)
    bus.flush()
    assert len(positions) == BATCHES * PER_BATCH
    values = stored_values(bus, topic)
    assert sorted(values) == sorted(m.value for n in range(BATCHES) for m in batch(n))
    for p in (0, 1):  # each partition holds its batches in the order they were appended
        ours = [pos.offset for pos in positions if pos.partition == p]
        assert ours == sorted(ours)


def test_append_many_waiting_queues_all_topics_or_none(
    backend: str, open_buses: Callable[..., Bus], unique: Callable[[str], str]
) -> None:
    bus = open_buses(**small_queue(backend))
    topics = [unique(name) for name in ("many-a", "many-b")]
    for t in topics:
        bus.create_topic(t, partitions=1)
    futures = [
        f
        for n in range(BATCHES // 2)
        for f in append_many_waiting(bus, {t: batch(n) for t in topics})
    ]
    for f in futures:
        f.result(timeout=60)
    bus.flush()
    assert [bus.watermarks(t, 0)[1] for t in topics] == [BATCHES // 2 * PER_BATCH] * 2


def test_a_set_stop_gives_up_on_a_full_queue_at_once(
    backend: str, open_buses: Callable[..., Bus], unique: Callable[[str], str]
) -> None:
    """With ``stop`` set, a full queue raises ``QueueFull`` instead of waiting, and the batch
    it refused is not stored."""
    bus = open_buses(**small_queue(backend))
    topic = unique("stop")
    bus.create_topic(topic, partitions=1)
    stop = threading.Event()
    stop.set()
    accepted: list[Future[Any]] = []
    with pytest.raises(QueueFull):
        for n in range(BATCHES * 10):
            accepted.append(append_waiting(bus, topic, batch(n), stop=stop))
    for f in accepted:
        f.result(timeout=60)
    bus.flush()
    assert bus.watermarks(topic, 0)[1] == len(accepted) * PER_BATCH


def test_a_deadline_bounds_the_wait(
    backend: str, open_buses: Callable[..., Bus], unique: Callable[[str], str]
) -> None:
    """A deadline already past: the first full queue ends the appends with ``QueueFull``."""
    bus = open_buses(**small_queue(backend))
    topic = unique("deadline")
    bus.create_topic(topic, partitions=1)
    accepted: list[Future[Any]] = []
    with pytest.raises(QueueFull):
        for n in range(BATCHES * 10):
            accepted.append(append_waiting(bus, topic, batch(n), deadline=0.0))
    for f in accepted:
        f.result(timeout=60)
