"""The embedded log's columnar ``read_arrow``: the same records as ``read`` (the contract suite
checks the layout) where only this backend has them: offset gaps left by compaction, records
written but not yet durable, a torn tail seen by a read-only reader, a corrupt batch; and small
stored batches built together into larger Arrow batches."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from headwater.bus.arrow import ARROW_SCHEMA, to_record_batch
from headwater.bus.embedded import arrow
from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.errors import CorruptLog
from headwater.bus.records import Message, TopicPartition

OpenLog = Callable[..., EmbeddedBus]


def _segments(root: Path) -> list[Path]:
    return sorted((root / "log" / "topics" / "t" / "0").glob("*.log"))


def _fill(bus: EmbeddedBus, batches: int, per: int, seed: int = 3) -> None:
    """Batches of keyed (a few keys, some records without one) records with headers."""
    rng = random.Random(seed)
    for b in range(batches):
        messages = [
            Message(
                b"value-%d-%d" % (b, i) * rng.randint(0, 3),
                key=None if rng.random() < 0.2 else b"key-%d" % rng.randrange(6),
                headers=tuple((f"h{j}", b"x" * j) for j in range(rng.randint(0, 4))),
                partition=0,
            )
            for i in range(per)
        ]
        bus.append("t", messages).result(timeout=30)


def _same_as_read(bus: EmbeddedBus, offset: int, end: int, max_records: int = 100_000) -> int:
    """Assert ``read_arrow`` equals ``read``'s records in Arrow; return how many rows."""
    batches = bus.read_arrow("t", 0, offset, end, max_records=max_records)
    records = [r for r in bus.read("t", 0, offset, max_records=max_records) if r.offset < end]
    got = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
    assert got.equals(pa.Table.from_batches([to_record_batch(records)]))
    return got.num_rows


def test_compaction_gaps_are_skipped(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=2048, default_partitions=1)
    _fill(bus, 40, 25)
    bus.commit("writer", {TopicPartition("t", 0): 700})
    (result,) = bus.compact("t")
    assert result.records_after < result.records_before
    offsets = [r.offset for r in bus.read("t", 0, 0, max_records=10_000)]
    gaps = [o for o in range(1000) if o not in set(offsets)]
    assert gaps
    assert _same_as_read(bus, 0, 1000) == len(offsets)
    for start in gaps[:5] + gaps[-5:]:  # from an offset compaction removed: the next survivor
        _same_as_read(bus, start, start + 40)
        _same_as_read(bus, start, 1000, max_records=7)
    _same_as_read(bus, gaps[0], gaps[0] + 1)  # a range holding nothing but a gap
    assert bus.read_arrow("t", 0, gaps[0], gaps[0] + 1) == []


def test_records_not_yet_durable_are_not_read(open_log: OpenLog) -> None:
    bus = open_log(default_partitions=1)
    _fill(bus, 3, 10)
    part = bus._topics["t"][0]
    part.durable_offset = 15  # as if the last 15 records were written but not yet fdatasync'd
    assert _same_as_read(bus, 0, 30) == 15
    assert bus.read_arrow("t", 0, 15) == []


def test_a_read_only_reader_stops_before_a_torn_tail(open_log: OpenLog, tmp_path: Path) -> None:
    bus = open_log(default_partitions=1)
    _fill(bus, 5, 10)
    bus.close()
    torn = fmt.frame(fmt.encode([Message(b"being written" * 20)], 0), 50)
    with open(_segments(tmp_path)[-1], "ab") as f:
        f.write(torn[: len(torn) // 2])
    reader = open_log(read_only=True, default_partitions=1)
    assert _same_as_read(reader, 0, 100) == 50


def test_a_corrupt_batch_raises_as_read_does(
    open_log: OpenLog, tmp_path: Path, flip_byte: Callable[[Path, int], None]
) -> None:
    bus = open_log(default_partitions=1, segment_bytes=4096)
    _fill(bus, 60, 10)
    bus.close()
    closed = _segments(tmp_path)[1]
    flip_byte(closed, 200)
    bus = open_log(default_partitions=1, segment_bytes=4096)
    first_of_closed = int(closed.stem)
    assert _same_as_read(bus, 0, first_of_closed, first_of_closed) == first_of_closed
    with pytest.raises(CorruptLog) as from_read:
        bus.read("t", 0, first_of_closed, max_records=1000)
    with pytest.raises(CorruptLog) as from_arrow:
        bus.read_arrow("t", 0, first_of_closed)
    assert str(from_arrow.value) == str(from_read.value)
    assert str(closed) in str(from_arrow.value)


def test_small_stored_batches_become_larger_arrow_batches(
    open_log: OpenLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = open_log(default_partitions=1)
    _fill(bus, 40, 25)
    (whole,) = bus.read_arrow("t", 0, 0)
    assert whole.num_rows == 1000
    monkeypatch.setattr(arrow, "ROWS_PER_BATCH", 120)
    batches = bus.read_arrow("t", 0, 10, 990)
    # whole stored batches of 25 go together up to 120 rows; the first and last are sliced
    assert [b.num_rows for b in batches] == [90, *[100] * 8, 90]
    assert _same_as_read(bus, 10, 990) == 980
    monkeypatch.setattr(arrow, "ROWS_PER_BATCH", 10)  # a stored batch larger stays whole
    assert {b.num_rows for b in bus.read_arrow("t", 0, 0, 100)} == {25}
    monkeypatch.setattr(arrow, "ROWS_PER_BATCH", 120)
    monkeypatch.setattr(arrow, "ALONE_BYTES", 0)  # every stored batch is "large": each alone
    assert [b.num_rows for b in bus.read_arrow("t", 0, 10, 90)] == [15, 25, 25, 15]
    assert _same_as_read(bus, 10, 990) == 980


def test_a_large_batch_is_read_whole(open_log: OpenLog) -> None:
    """A batch larger than the segment's read chunk (1 MiB) is read in one piece."""
    bus = open_log(default_partitions=1)
    messages = [
        Message(bytes([i]) * 300_000, key=b"k", headers=(("i", b"%d" % i),)) for i in range(8)
    ]
    bus.append("t", [m._replace(partition=0) for m in messages]).result(timeout=30)
    assert _same_as_read(bus, 0, 8) == 8
    assert _same_as_read(bus, 3, 5) == 2
