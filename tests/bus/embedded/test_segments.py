"""Segments roll, reads work from any segment while appends continue, and state survives."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.errors import LogLocked, OffsetOutOfRange, RecordTooLarge
from headwater.bus.records import Message

OpenLog = Callable[..., EmbeddedBus]


def _batch(start: int, n: int, size: int = 100) -> list[Message]:
    return [Message(f"{i:08d}".encode().ljust(size, b".")) for i in range(start, start + n)]


def test_segments_roll_and_every_offset_reads_back(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=4096, index_interval_bytes=512, default_partitions=1)
    for start in range(0, 1000, 50):
        bus.append("t", _batch(start, 50)).result(timeout=30)
    part = bus._topics["t"][0]
    assert len(part.segments) > 10
    for offset in (0, 1, 49, 50, 333, 998, 999):
        (rec,) = bus.read("t", 0, offset, max_records=1)
        assert rec.offset == offset
        assert rec.value.startswith(f"{offset:08d}".encode())
    everything = bus.read("t", 0, 0, max_records=5000)
    assert [r.offset for r in everything] == list(range(1000))
    assert bus.read("t", 0, 1000) == []
    with pytest.raises(OffsetOutOfRange, match="1001"):
        bus.read("t", 0, 1001)


def test_reads_while_appends_continue(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=8192, default_partitions=1, durability="never")
    bus.create_topic("t")
    total, errors = 4000, []

    def writer() -> None:
        for start in range(0, total, 40):
            bus.append("t", _batch(start, 40)).result(timeout=30)

    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    try:
        with bus.consumer("reader", ["t"]) as consumer:
            while len(seen) < total:
                writer_alive = thread.is_alive()
                records = consumer.poll(300, timeout=5)
                for r in records:
                    if r.value[:8] != f"{r.offset:08d}".encode():
                        errors.append(r.offset)
                seen += [r.offset for r in records]
                if not records:
                    assert writer_alive, "the writer finished but records are missing"
    finally:
        thread.join()
    assert seen == list(range(total))
    assert errors == []


def test_state_survives_clean_reopen(open_log: OpenLog) -> None:
    bus = open_log(segment_bytes=4096)
    positions = bus.append("t", [Message(b"v%d" % i, key=b"k%d" % i) for i in range(300)]).result(
        timeout=30
    )
    bus.close()
    bus = open_log(segment_bytes=4096)
    for pos in positions[::37]:
        (rec,) = bus.read("t", pos.partition, pos.offset, max_records=1)
        assert rec.key is not None and rec.value == b"v" + rec.key[1:]
    more = bus.append("t", [Message(b"after", partition=0)]).result(timeout=30)
    assert more[0].offset == max(p.offset for p in positions if p.partition == 0) + 1


def test_one_writer_per_directory_many_readers(open_log: OpenLog) -> None:
    bus = open_log()
    bus.append("t", [Message(b"x")]).result(timeout=30)
    with pytest.raises(LogLocked, match=str(__import__("os").getpid())):
        open_log()
    reader = open_log(read_only=True)
    assert [t.name for t in reader.topics()] == ["t"]
    bus.append("t", [Message(b"y", partition=0), Message(b"z", partition=0)]).result(timeout=30)
    assert [r.value for r in reader.read("t", 0, 0)][-2:] == [b"y", b"z"]


def test_record_too_large_appends_nothing(open_log: OpenLog) -> None:
    bus = open_log(max_record_bytes=1000, default_partitions=1)
    with pytest.raises(RecordTooLarge, match=r"record 1 .* 1001 bytes"):
        bus.append("t", [Message(b"a"), Message(b"b" * 1001)])
    assert bus.watermarks("t", 0) == (0, 0)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (Message("text"), "value must be bytes"),  # type: ignore[arg-type]
        (Message(b"v", key="k"), "key must be bytes"),  # type: ignore[arg-type]
        (Message(b"v", headers=(("h", "text"),)), "must be a \\(str, bytes\\) pair"),  # type: ignore[arg-type]
        (Message(b"v", timestamp=-5), "timestamp must be"),
        (Message(b"v", timestamp="now"), "timestamp must be"),  # type: ignore[arg-type]
        (Message(b"v", partition="0"), "partition must be"),  # type: ignore[arg-type]
    ],
)
def test_bad_messages_are_named_and_append_nothing(
    open_log: OpenLog, message: Message, problem: str
) -> None:
    from headwater.bus.errors import InvalidArgument

    bus = open_log(default_partitions=1)
    with pytest.raises(InvalidArgument, match=f"record 1 .*{problem}"):
        bus.append("t", [Message(b"fine"), message])
    assert bus.watermarks("t", 0) == (0, 0)


def test_a_consumer_at_the_tail_reads_from_the_batch_it_asks_for(open_log: OpenLog) -> None:
    """The start of a batch appended lately is known exactly (not only the sparse index's
    position before it), so a consumer at the tail parses no batch it has read already; after a
    truncation nothing remembered is used."""
    bus = open_log(index_interval_bytes=1 << 20)  # (one index entry: the segment's start)
    bus.create_topic("t", 1)
    consumer = bus.consumer("g", ["t"])
    for i in range(50):
        bus.append("t", [Message(b"%d-%d" % (i, k)) for k in range(3)]).result()
        assert [r.value for r in consumer.poll(10, 0)] == [b"%d-%d" % (i, k) for k in range(3)]
    segment = bus._topics["t"][0].segments[-1]
    assert segment.position_for(0) == 0
    starts = [segment.position_for(3 * i) for i in range(50)]
    assert starts == sorted(set(starts)) and starts[0] == 0  # each batch's own start
    assert segment.position_for(4) == 0  # inside a batch: the index's position
    segment.truncate(segment.size)
    assert segment.position_for(3 * 49) == 0
    assert [r.value for r in consumer.poll(10, 0)] == []
