"""Recovery on open: a torn tail is truncated; corruption before the tail is an error naming the
file and position, never skipped."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.errors import CorruptLog
from headwater.bus.records import Message

OpenLog = Callable[..., EmbeddedBus]


def _segments(root: Path, topic: str = "t", partition: int = 0) -> list[Path]:
    return sorted((root / "log" / "topics" / topic / str(partition)).glob("*.log"))


def _fill(bus, batches: int, per: int = 10) -> None:
    for b in range(batches):
        bus.append("t", [Message(b"%d-%d" % (b, i) * 5) for i in range(per)]).result(timeout=30)


def _crash(bus) -> None:
    """Leave the log as a killed process would: no clean marker, no index of the active segment."""
    bus.close()
    (bus.directory / "CLEAN").unlink()


@pytest.mark.parametrize("damage", ["half batch", "garbage", "zeros", "header only"])
def test_torn_tail_is_truncated_and_appending_continues(
    open_log: OpenLog, tmp_path: Path, damage: str
) -> None:
    bus = open_log(default_partitions=1)
    _fill(bus, 5)
    _crash(bus)
    seg = _segments(tmp_path)[-1]
    good_size = seg.stat().st_size
    torn = fmt.frame(fmt.encode([Message(b"never acked" * 20)], 0), 50)
    tail = {
        "half batch": torn[: len(torn) // 2],
        "garbage": os.urandom(300),
        "zeros": bytes(4096),
        "header only": torn[: fmt.HEADER_SIZE],
    }[damage]
    with open(seg, "ab") as f:
        f.write(tail)

    bus = open_log(default_partitions=1)
    assert seg.stat().st_size == good_size
    assert bus.watermarks("t", 0) == (0, 50)
    records = bus.read("t", 0, 0, max_records=1000)
    assert len(records) == 50 and all(b"never acked" not in r.value for r in records)
    (pos,) = bus.append("t", [Message(b"after recovery", partition=0)]).result(timeout=30)
    assert pos.offset == 50
    assert bus.read("t", 0, 50)[0].value == b"after recovery"


def test_corruption_before_the_tail_names_file_and_position(
    open_log: OpenLog, tmp_path: Path
) -> None:
    bus = open_log(default_partitions=1)
    _fill(bus, 5)
    _crash(bus)
    seg = _segments(tmp_path)[-1]
    batch_size = seg.stat().st_size // 5
    position = 2 * batch_size + fmt.HEADER_SIZE + 30  # inside the third batch's columns
    with open(seg, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptLog) as info:
        open_log(default_partitions=1)
    message = str(info.value)
    assert info.value.code == "HW-BUS-008"
    assert str(seg) in message and f"byte {2 * batch_size}" in message
    assert "offset 20" in message
    assert seg.stat().st_size > 4 * batch_size, "nothing was truncated"


def test_flipped_byte_in_closed_segment_is_reported_on_read(
    open_log: OpenLog, tmp_path: Path, flip_byte: Callable[[Path, int], None]
) -> None:
    bus = open_log(default_partitions=1, segment_bytes=4096)
    _fill(bus, 60)
    bus.close()
    closed = _segments(tmp_path)[1]
    flip_byte(closed, 200)
    bus = open_log(default_partitions=1, segment_bytes=4096)
    first_of_closed = int(closed.stem)
    before = bus.read("t", 0, 0, max_records=first_of_closed)
    assert len(before) == first_of_closed  # the segments before it still read
    with pytest.raises(CorruptLog) as info:
        bus.read("t", 0, first_of_closed, max_records=1000)
    assert str(closed) in str(info.value) and "byte 0" in str(info.value)
    assert f"offset {first_of_closed}" in str(info.value)


def test_closed_segment_without_index_is_rebuilt(open_log: OpenLog, tmp_path: Path) -> None:
    bus = open_log(default_partitions=1, segment_bytes=4096)
    _fill(bus, 40)
    bus.close()
    for index in (tmp_path / "log" / "topics" / "t" / "0").glob("*.index"):
        index.unlink()
    bus = open_log(default_partitions=1, segment_bytes=4096)
    assert [r.offset for r in bus.read("t", 0, 0, max_records=1000)] == list(range(400))


@pytest.mark.parametrize("chunk", [fmt.HEADER_SIZE + 1, 97, 200, 333])
def test_scanning_in_chunks_reads_batch_headers_that_straddle_a_chunk_end(
    open_log: OpenLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Recovery and read-only tails scan segments in chunks; wherever a chunk ends (inside a
    header, inside a body, on a boundary), every batch is found."""
    from headwater.bus.embedded import segment

    bus = open_log(default_partitions=1)
    _fill(bus, 20, per=3)
    _crash(bus)
    monkeypatch.setattr(segment, "SCAN_CHUNK", chunk)
    reader = open_log(read_only=True, default_partitions=1)
    assert reader.watermarks("t", 0) == (0, 60)
    reader.close()
    bus = open_log(default_partitions=1)  # recovery scans the active segment
    assert bus.watermarks("t", 0) == (0, 60)
    assert [r.value for r in bus.read("t", 0, 0, max_records=100)][-1] == b"19-2" * 5
