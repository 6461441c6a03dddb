"""Compaction keeps exactly the latest record per key below the lowest writer offset, leaves the
active segment and everything at or above that offset alone, and never changes offsets."""

from __future__ import annotations

import random
from collections.abc import Callable

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.records import Message, TopicPartition

OpenLog = Callable[..., EmbeddedBus]


def _fill(bus: EmbeddedBus, n: int, keys: int, seed: int = 7) -> list[bytes | None]:
    rng = random.Random(seed)
    written: list[bytes | None] = []
    for start in range(0, n, 25):
        batch = []
        for i in range(start, min(n, start + 25)):
            key = None if rng.random() < 0.1 else b"key-%d" % rng.randrange(keys)
            batch.append(Message(b"value-%d" % i, key=key, partition=0))
            written.append(key)
        bus.append("t", batch).result(timeout=30)
    return written


def _expected(written: list[bytes | None], cutoff: int, active_base: int) -> list[int]:
    """Offsets that must survive: below min(cutoff, active base) only the latest per key (among
    offsets below the cutoff) and unkeyed records; everything else untouched."""
    latest = {k: o for o, k in enumerate(written) if k is not None and o < cutoff}
    limit = min(cutoff, active_base)
    return [o for o, k in enumerate(written) if o >= limit or k is None or latest[k] == o]


def test_compaction_keeps_latest_per_key_below_lowest_writer(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=2048, default_partitions=1)
    written = _fill(bus, 1500, keys=40)
    bus.commit("slow", {TopicPartition("t", 0): 900})
    bus.commit("fast", {TopicPartition("t", 0): 1400})
    part = bus._topics["t"][0]
    active_base = part.segments[-1].base_offset
    (result,) = bus.compact("t")
    expected = _expected(written, 900, active_base)
    survivors = bus.read("t", 0, 0, max_records=10_000)
    assert [r.offset for r in survivors] == expected
    assert all(r.value == b"value-%d" % r.offset for r in survivors)
    assert result.records_before - result.records_after == len(written) - len(expected) > 0
    assert result.bytes_after < result.bytes_before
    # offsets are stable: a read from a removed offset starts at the next survivor
    removed = next(o for o in range(1500) if o not in set(expected))
    assert bus.read("t", 0, removed, max_records=1)[0].offset == min(
        o for o in expected if o > removed
    )
    assert bus.watermarks("t", 0) == (0, 1500)
    # appending continues, and the compacted state survives a reopen
    bus.append("t", [Message(b"value-1500", partition=0)]).result(timeout=30)
    bus.close()
    bus = open_log(segment_bytes=2048, default_partitions=1)
    assert [r.offset for r in bus.read("t", 0, 0, max_records=10_000)] == [*expected, 1500]


def test_compaction_without_writers_stops_at_active_segment(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=2048, default_partitions=1)
    written = _fill(bus, 600, keys=5)
    active_base = bus._topics["t"][0].segments[-1].base_offset
    bus.compact()
    expected = _expected(written, 600, active_base)
    assert [r.offset for r in bus.read("t", 0, 0, max_records=10_000)] == expected
    again = bus.compact("t")
    assert again[0].segments == 0, "a second compaction has nothing to remove"


def test_stray_compaction_output_is_removed_on_open(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=2048, default_partitions=1)
    _fill(bus, 300, keys=5)
    bus.close()
    directory = bus.directory / "topics" / "t" / "0"
    first = sorted(directory.glob("*.log"))[0]
    stray = first.with_name(first.name + ".cleaned")
    stray.write_bytes(b"half-written compaction output")
    bus = open_log(segment_bytes=2048, default_partitions=1)
    assert not stray.exists()
    assert len(bus.read("t", 0, 0, max_records=1000)) == 300
