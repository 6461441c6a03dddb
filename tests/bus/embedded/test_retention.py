"""Retention deletes closed segments by size and time, never past a registered writer's
committed offset unless told to; the active segment always stays."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import RetentionConfig
from headwater.bus.errors import OffsetOutOfRange
from headwater.bus.records import Message, TopicPartition

OpenLog = Callable[..., EmbeddedBus]


def _fill(bus: EmbeddedBus, n: int, timestamp: int | None = None) -> None:
    for _ in range(0, n, 20):
        bus.append(
            "t", [Message(b"x" * 100, timestamp=timestamp, partition=0) for _ in range(20)]
        ).result(timeout=30)


def test_size_retention_respects_the_slowest_writer(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=4096, default_partitions=1, retention=RetentionConfig(bytes=8192))
    _fill(bus, 1000)
    bus.commit("w", {TopicPartition("t", 0): 300})
    deleted = bus.enforce_retention()
    low, high = bus.watermarks("t", 0)
    assert deleted > 0 and 0 < low <= 300 and high == 1000
    assert bus.read("t", 0, low)[0].offset == low
    with pytest.raises(OffsetOutOfRange):
        bus.read("t", 0, low - 1)
    bus.commit("w", {TopicPartition("t", 0): 1000})
    bus.enforce_retention()
    part = bus._topics["t"][0]
    assert part.size_bytes() <= 8192 + 4096 + 2500
    assert bus.watermarks("t", 0)[1] == 1000
    assert bus.read("t", 0, bus.watermarks("t", 0)[0], max_records=5000)[-1].offset == 999


def test_time_retention_and_opting_out_of_writer_protection(open_log: OpenLog) -> None:
    bus = open_log(
        segment_bytes=4096,
        default_partitions=1,
        retention=RetentionConfig(ms=60_000, respect_writers=False),
    )
    _fill(bus, 400, timestamp=1_000)  # ancient records
    bus.commit("w", {TopicPartition("t", 0): 0})
    _fill(bus, 40)  # fresh ones
    bus.enforce_retention()
    low, high = bus.watermarks("t", 0)
    assert low >= 300, "old segments go even though writer 'w' has not read them"
    assert all(r.timestamp > 1_000 or r.offset >= low for r in bus.read("t", 0, low, 1000))
    assert high == 440


def test_no_retention_configured_deletes_nothing(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=4096, default_partitions=1)
    _fill(bus, 1000)
    assert bus.enforce_retention() == 0
    assert bus.watermarks("t", 0) == (0, 1000)


def test_retention_runs_by_itself_while_the_log_is_open(open_log: OpenLog) -> None:
    retention = RetentionConfig(bytes=4096, check_interval_ms=20)
    bus = open_log(segment_bytes=4096, default_partitions=1, retention=retention)
    _fill(bus, 1000)
    deadline = time.monotonic() + 10
    while bus.watermarks("t", 0)[0] == 0:
        assert time.monotonic() < deadline, "retention never ran"
        time.sleep(0.01)
    assert bus.watermarks("t", 0)[1] == 1000
