"""The bus contract, run over both backends (the ``bus`` fixture is parametrized): the
embedded log and Apache Kafka (one broker in KRaft mode)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence

import pyarrow as pa
import pytest

from headwater.bus import Bus, Consumer
from headwater.bus.arrow import ARROW_SCHEMA, to_record_batch
from headwater.bus.errors import (
    BusClosed,
    InvalidArgument,
    InvalidTopicName,
    OffsetOutOfRange,
    RecordTooLarge,
    UnknownPartition,
    UnknownTopic,
)
from headwater.bus.records import Message, Position, Record, TopicInfo, TopicPartition

Unique = Callable[[str], str]
WAIT_S = 30.0


def append(bus: Bus, topic: str, messages: Sequence[Message]) -> list[Position]:
    return bus.append(topic, messages).result(timeout=WAIT_S)


def append_each(bus: Bus, topic: str, messages: Sequence[Message]) -> list[Position]:
    """Append one message per batch (so every batch is a single record)."""
    return [append(bus, topic, [m])[0] for m in messages]


def read_all(bus: Bus, topic: str, partition: int) -> list[Record]:
    low, _ = bus.watermarks(topic, partition)
    return bus.read(topic, partition, low, max_records=100_000)


def poll_until(consumer: Consumer, count: int, timeout: float = WAIT_S) -> list[Record]:
    """Poll until ``count`` records arrived (Kafka assigns partitions during the first polls)."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    while len(records) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(records)} of {count} records arrived in {timeout} s"
        records += consumer.poll(max_records=count - len(records), timeout=min(left, 1.0))
    return records


# -- topics -------------------------------------------------------------------------------


def test_create_topic_and_list(bus: Bus, unique: Unique) -> None:
    name = unique("orders")
    info = bus.create_topic(name, partitions=3)
    assert info == TopicInfo(name, 3, 1)
    assert bus.topic(name) == info
    listed = bus.topics()
    assert info in listed
    assert [t.name for t in listed] == sorted(t.name for t in listed)


def test_create_existing_topic_returns_it(bus: Bus, unique: Unique) -> None:
    name = unique("again")
    bus.create_topic(name, partitions=3)
    assert bus.create_topic(name, partitions=5).partitions == 3
    assert bus.create_topic(name).partitions == 3


def test_create_topic_defaults_to_configured_partitions(bus: Bus, unique: Unique) -> None:
    assert bus.create_topic(unique("default")).partitions == 2


def test_create_topic_rejects_zero_partitions(bus: Bus, unique: Unique) -> None:
    with pytest.raises(InvalidArgument):
        bus.create_topic(unique("zero"), partitions=0)


def test_unknown_topic(bus: Bus, unique: Unique) -> None:
    name = unique("missing")
    with pytest.raises(UnknownTopic):
        bus.topic(name)
    with pytest.raises(UnknownTopic):
        bus.read(name, 0, 0)
    with pytest.raises(UnknownTopic):
        bus.watermarks(name, 0)
    assert name not in [t.name for t in bus.topics()]


@pytest.mark.parametrize(
    "name", ["", "has space", "a/b", "..", ".", "x" * 250, "naïve", "tab\t", "semi;colon"]
)
def test_invalid_topic_names(bus: Bus, name: str) -> None:
    with pytest.raises(InvalidTopicName):
        bus.create_topic(name)
    with pytest.raises(InvalidTopicName):
        bus.append(name, [Message(b"v")])
    with pytest.raises(InvalidTopicName):
        bus.topic(name)


def test_longest_valid_topic_name(bus: Bus, unique: Unique) -> None:
    name = unique("a" * 249)[-249:]
    assert bus.create_topic(name, partitions=1).name == name


# -- append and read ----------------------------------------------------------------------


def test_append_and_read_back_byte_identical(bus: Bus, unique: Unique) -> None:
    topic = unique("bytes")
    bus.create_topic(topic, partitions=1)
    messages = [
        Message(b'{"event":"signup"}', key=b"user-1", timestamp=1_700_000_000_000),
        Message(b"\xff\xfe\x00binary\x80", key=b"\x00\xff\xc3", timestamp=1_700_000_000_001),
        Message(
            b"with headers",
            key=None,
            headers=(
                ("content-type", b"application/json"),
                ("raw", b"\xff\x00\xfe"),
                ("dup", b"1"),
                ("dup", b"2"),
                ("empty", b""),
                ("ünïcode-name", b"x"),
            ),
            timestamp=1_600_000_000_000,
        ),
        Message(b"", key=b"empty-value", timestamp=1_700_000_000_003),
        Message(b"v" * 10_000, key=b"k" * 300, headers=(("h", b"\x01" * 500),), timestamp=5),
    ]
    positions = append(bus, topic, messages)
    assert positions == [Position(0, i) for i in range(len(messages))]

    records = bus.read(topic, 0, 0)
    expected = [
        Record(topic, 0, i, m.timestamp or 0, m.key, m.value, m.headers)
        for i, m in enumerate(messages)
    ]
    assert records == expected
    for record in records:
        assert type(record.value) is bytes
        assert type(record.headers) is tuple
        assert all(type(n) is str and type(v) is bytes for n, v in record.headers)


def test_default_timestamp_is_append_time(bus: Bus, unique: Unique) -> None:
    topic = unique("stamp")
    bus.create_topic(topic, partitions=1)
    before = time.time_ns() // 1_000_000
    append(bus, topic, [Message(b"now")])
    after = time.time_ns() // 1_000_000
    (record,) = bus.read(topic, 0, 0)
    assert before - 5 <= record.timestamp <= after + 5


def test_append_empty_batch(bus: Bus, unique: Unique) -> None:
    topic = unique("nothing")
    bus.create_topic(topic, partitions=1)
    assert append(bus, topic, []) == []
    assert bus.watermarks(topic, 0) == (0, 0)


def test_keyed_partitioning_is_crc32_of_the_key(bus: Bus, unique: Unique) -> None:
    topic = unique("keyed")
    bus.create_topic(topic, partitions=4)
    keys = [f"user-{i}".encode() for i in range(40)]
    positions = append(bus, topic, [Message(b"v-" + k, key=k) for k in keys])
    assert [p.partition for p in positions] == [zlib.crc32(k) % 4 for k in keys]
    assert len({p.partition for p in positions}) == 4
    # The same key always lands on the same partition, in a later batch too.
    again = append(bus, topic, [Message(b"again", key=keys[7])])
    assert again[0].partition == positions[7].partition


def test_positions_are_in_input_order(bus: Bus, unique: Unique) -> None:
    topic = unique("order")
    bus.create_topic(topic, partitions=3)
    messages = [Message(f"m{i}".encode(), key=f"k{i % 5}".encode()) for i in range(30)]
    messages.append(Message(b"pinned", partition=2))
    positions = append(bus, topic, messages)
    assert len(positions) == len(messages)
    assert positions[-1].partition == 2
    per_partition: dict[int, list[int]] = {}
    for p in positions:
        per_partition.setdefault(p.partition, []).append(p.offset)
    for offsets in per_partition.values():  # consecutive, in the order the batch gave them
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets)))
    by_position = {
        (r.partition, r.offset): r.value for p in range(3) for r in read_all(bus, topic, p)
    }
    assert [by_position[p] for p in positions] == [m.value for m in messages]


def test_explicit_partition_out_of_range(bus: Bus, unique: Unique) -> None:
    topic = unique("pinned")
    bus.create_topic(topic, partitions=2)
    with pytest.raises(UnknownPartition):
        bus.append(topic, [Message(b"ok", partition=1), Message(b"bad", partition=2)])
    assert bus.watermarks(topic, 1) == (0, 0)


def test_append_auto_creates_topic(bus: Bus, unique: Unique) -> None:
    topic = unique("auto")
    positions = append(bus, topic, [Message(b"first", key=b"k")])
    assert bus.topic(topic).partitions == 2
    assert positions[0].partition == zlib.crc32(b"k") % 2


def test_append_to_unknown_topic_without_auto_create(
    open_buses: Callable[..., Bus], unique: Unique
) -> None:
    bus = open_buses(auto_create_topics=False)
    with pytest.raises(UnknownTopic):
        bus.append(unique("nope"), [Message(b"v")])


def test_record_too_large_appends_nothing(open_buses: Callable[..., Bus], unique: Unique) -> None:
    bus = open_buses(max_record_bytes=1024)
    topic = unique("large")
    bus.create_topic(topic, partitions=1)
    with pytest.raises(RecordTooLarge):
        bus.append(topic, [Message(b"small"), Message(b"x" * 1025)])
    with pytest.raises(RecordTooLarge):
        bus.append(topic, [Message(b"x" * 1000, key=b"k" * 25)])
    with pytest.raises(RecordTooLarge):
        bus.append(topic, [Message(b"x" * 1000, headers=(("h", b"y" * 30),))])
    assert bus.watermarks(topic, 0) == (0, 0)
    # Exactly at the limit is accepted.
    assert append(bus, topic, [Message(b"x" * 1024)]) == [Position(0, 0)]


# -- offsets ------------------------------------------------------------------------------


def test_read_from_offset(bus: Bus, unique: Unique) -> None:
    topic = unique("offsets")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(f"r{i}".encode()) for i in range(5)])
    append(bus, topic, [Message(b"r5")])

    assert [r.offset for r in bus.read(topic, 0, 2)] == [2, 3, 4, 5]
    assert [r.value for r in bus.read(topic, 0, 3, max_records=2)] == [b"r3", b"r4"]
    # max_bytes bounds the read (a backend may round up to whole stored batches), but the
    # first record is returned even when it alone is larger.
    bounded = [r.offset for r in bus.read(topic, 0, 1, max_bytes=1)]
    assert bounded == list(range(1, 1 + len(bounded)))
    assert bounded
    assert bus.read(topic, 0, 6) == []  # at the high watermark: nothing yet
    with pytest.raises(OffsetOutOfRange):
        bus.read(topic, 0, 7)
    with pytest.raises(OffsetOutOfRange):
        bus.read(topic, 0, -1)
    with pytest.raises(UnknownPartition):
        bus.read(topic, 1, 0)
    with pytest.raises(InvalidArgument):
        bus.read(topic, 0, 0, max_records=0)


def test_read_sees_records_appended_later(bus: Bus, unique: Unique) -> None:
    topic = unique("tail")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"a")])
    assert [r.value for r in bus.read(topic, 0, 0)] == [b"a"]
    append(bus, topic, [Message(b"b")])
    assert [r.value for r in bus.read(topic, 0, 1)] == [b"b"]
    assert [r.value for r in bus.read(topic, 0, 0)] == [b"a", b"b"]


def test_watermarks_of_an_empty_partition(bus: Bus, unique: Unique) -> None:
    topic = unique("empty")
    bus.create_topic(topic, partitions=2)
    assert bus.watermarks(topic, 0) == (0, 0)
    assert bus.watermarks(topic, 1) == (0, 0)
    with pytest.raises(UnknownPartition):
        bus.watermarks(topic, 2)


def test_watermarks_after_batches(bus: Bus, unique: Unique) -> None:
    topic = unique("marks")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"a"), Message(b"b"), Message(b"c")])
    append(bus, topic, [Message(b"d"), Message(b"e")])
    assert bus.watermarks(topic, 0) == (0, 5)


# -- read_arrow ---------------------------------------------------------------------------


def records_as_arrow(bus: Bus, topic: str, offset: int, end: int, max_records: int) -> pa.Table:
    """What ``read_arrow`` must return: ``read``'s records of ``[offset, end)`` in Arrow."""
    records = [r for r in bus.read(topic, 0, offset, max_records=max_records) if r.offset < end]
    return pa.Table.from_batches([to_record_batch(records)])


def assert_read_arrow(bus: Bus, topic: str, offset: int, end: int, max_records: int) -> None:
    batches = bus.read_arrow(topic, 0, offset, end, max_records=max_records)
    assert all(b.schema == ARROW_SCHEMA and b.num_rows > 0 for b in batches)
    got = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
    expected = records_as_arrow(bus, topic, offset, end, max_records)
    assert got.equals(expected), f"[{offset}, {end}) max {max_records}"


def test_read_arrow_is_the_kafka_layout_of_the_records(bus: Bus, unique: Unique) -> None:
    topic = unique("arrow")
    bus.create_topic(topic, partitions=1)
    many = tuple((f"h{i}", bytes([i]) * i) for i in range(40))
    messages = [
        Message(b'{"event":"signup"}', key=b"user-1", timestamp=1_700_000_000_000),
        Message(b"no key, no headers", timestamp=1_700_000_000_001),
        Message(b"", key=b"empty value", timestamp=1_700_000_000_002),
        Message(b"", timestamp=1_700_000_000_003),
        Message(b"many headers", headers=many, timestamp=1_700_000_000_004),
        Message(
            b"\xff\x00binary",
            key=b"",
            headers=(("empty", b""), ("ünïcode-名前", b"\xff\x00"), ("", b"nameless")),
            timestamp=1_600_000_000_000,
        ),
        Message(b"v" * 10_000, key=b"k" * 300, headers=(("h", b"\x01" * 500),), timestamp=5),
    ]
    append(bus, topic, messages)

    (batch,) = bus.read_arrow(topic, 0, 0)
    assert batch.schema == ARROW_SCHEMA
    assert batch.column("key").to_pylist() == [m.key for m in messages]
    assert batch.column("value").to_pylist() == [m.value for m in messages]
    assert batch.column("topic").to_pylist() == [topic] * len(messages)
    assert batch.column("partition").to_pylist() == [0] * len(messages)
    assert batch.column("offset").to_pylist() == list(range(len(messages)))
    assert batch.column("timestampType").to_pylist() == [0] * len(messages)
    micros = batch.column("timestamp").cast(pa.int64()).to_pylist()
    assert micros == [m.timestamp * 1000 for m in messages if m.timestamp is not None]
    headers = [
        tuple((h["key"], h["value"]) for h in hs) for hs in batch.column("headers").to_pylist()
    ]
    assert headers == [m.headers for m in messages]
    assert_read_arrow(bus, topic, 0, len(messages), 100)


def test_read_arrow_of_records_without_headers_or_keys(bus: Bus, unique: Unique) -> None:
    topic = unique("arrow-bare")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"value-%d" % i) for i in range(20)])
    append(bus, topic, [Message(b"last")])
    assert_read_arrow(bus, topic, 0, 21, 100)
    assert_read_arrow(bus, topic, 3, 17, 100)


def test_read_arrow_ranges_inside_and_across_batches(bus: Bus, unique: Unique) -> None:
    topic = unique("arrow-ranges")
    bus.create_topic(topic, partitions=1)
    sizes = [7, 1, 30, 12, 25, 3]
    offset = 0
    for n in sizes:
        append(
            bus,
            topic,
            [
                Message(
                    b"r%d" % (offset + i) * (i % 4),
                    key=None if i % 3 else b"k%d" % i,
                    headers=(("n", b"%d" % i),) * (i % 5),
                    timestamp=1_700_000_000_000 + offset + i,
                )
                for i in range(n)
            ],
        )
        offset += n
    append(bus, topic, [Message(b"last", timestamp=1_700_000_001_000)])  # see read_from_offset
    total = offset + 1
    cases = [
        (0, total, 1000),  # every batch, combined
        (3, 5, 1000),  # inside one batch
        (5, 40, 1000),  # from inside one batch to inside another
        (7, 8, 1000),  # one whole single-record batch
        (0, total, 20),  # max_records ends inside a batch
        (10, total, 1),
        (2, 70, 33),
        (total - 1, total + 10, 1000),  # an end past the high watermark
    ]
    for start, end, max_records in cases:
        assert_read_arrow(bus, topic, start, end, max_records)
    rows = sum(b.num_rows for b in bus.read_arrow(topic, 0, 0, max_records=1000))
    assert rows == total  # no end: up to the high watermark


def test_read_arrow_offsets_and_errors_as_read(bus: Bus, unique: Unique) -> None:
    topic = unique("arrow-errors")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"a"), Message(b"b")])
    append(bus, topic, [Message(b"c")])
    assert bus.read_arrow(topic, 0, 3) == []  # at the high watermark: nothing yet
    assert bus.read_arrow(topic, 0, 1, 1) == []  # an empty range
    with pytest.raises(OffsetOutOfRange):
        bus.read_arrow(topic, 0, 4)
    with pytest.raises(OffsetOutOfRange):
        bus.read_arrow(topic, 0, -1)
    with pytest.raises(UnknownPartition):
        bus.read_arrow(topic, 1, 0)
    with pytest.raises(UnknownTopic):
        bus.read_arrow(unique("missing"), 0, 0)
    with pytest.raises(InvalidArgument):
        bus.read_arrow(topic, 0, 0, max_records=0)


# -- groups -------------------------------------------------------------------------------


def test_commit_and_committed(bus: Bus, unique: Unique) -> None:
    topic, other, group = unique("committed"), unique("other"), unique("writer")
    bus.create_topic(topic, partitions=2)
    bus.create_topic(other, partitions=1)
    for p in (0, 1):
        append_each(bus, topic, [Message(b"x", partition=p), Message(b"y", partition=p)])
    append_each(bus, other, [Message(b"z")])

    assert bus.committed(group) == {}
    bus.commit(group, {TopicPartition(topic, 0): 2, TopicPartition(topic, 1): 0})
    bus.commit(group, {TopicPartition(other, 0): 1})
    assert bus.committed(group, [topic]) == {
        TopicPartition(topic, 0): 2,
        TopicPartition(topic, 1): 0,
    }
    assert bus.committed(group) == {
        TopicPartition(topic, 0): 2,
        TopicPartition(topic, 1): 0,
        TopicPartition(other, 0): 1,
    }
    assert bus.committed(group, [unique("never")]) == {}
    # Rewinding is a commit too.
    bus.commit(group, {TopicPartition(topic, 0): 1})
    assert bus.committed(group, [topic])[TopicPartition(topic, 0)] == 1

    groups = bus.groups()
    assert group in groups
    assert groups == sorted(groups)
    assert unique("idle") not in groups


def test_commit_rejects_bad_offsets(bus: Bus, unique: Unique) -> None:
    topic, group = unique("bad-commit"), unique("writer")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"x")])
    with pytest.raises(InvalidArgument):
        bus.commit(group, {TopicPartition(topic, 0): 5})
    with pytest.raises(InvalidArgument):
        bus.commit(group, {TopicPartition(topic, 0): -1})
    with pytest.raises(InvalidArgument):
        bus.commit("", {TopicPartition(topic, 0): 0})
    with pytest.raises(UnknownPartition):
        bus.commit(group, {TopicPartition(topic, 3): 0})
    assert bus.committed(group) == {}


def test_consumer_commits_and_a_new_consumer_resumes(
    open_buses: Callable[..., Bus], unique: Unique
) -> None:
    topic, group = unique("resume"), unique("writer")
    first_bus = open_buses()
    first_bus.create_topic(topic, partitions=2)
    sent = [Message(f"a{i}".encode(), key=f"k{i}".encode()) for i in range(10)]
    append(first_bus, topic, sent)

    with first_bus.consumer(group, [topic]) as consumer:
        records = poll_until(consumer, len(sent))
        assert sorted(r.value for r in records) == sorted(m.value for m in sent)
        assert consumer.poll(timeout=0.2) == []
        consumer.commit()
        assert sorted(consumer.assignment()) == [
            TopicPartition(topic, 0),
            TopicPartition(topic, 1),
        ]
    ends: dict[TopicPartition, int] = {}
    for r in records:
        tp = TopicPartition(r.topic, r.partition)
        ends[tp] = max(ends.get(tp, 0), r.offset + 1)
    assert first_bus.committed(group) == ends
    assert sum(ends.values()) == len(sent)
    assert group in first_bus.groups()

    later = [Message(f"b{i}".encode(), key=f"k{i}".encode()) for i in range(6)]
    append(first_bus, topic, later)
    first_bus.close()

    second_bus = open_buses()
    with second_bus.consumer(group, [topic]) as consumer:
        records = poll_until(consumer, len(later))
        assert sorted(r.value for r in records) == sorted(m.value for m in later)
        assert consumer.poll(timeout=0.2) == []
        consumer.commit()
    assert sum(second_bus.committed(group).values()) == len(sent) + len(later)


def test_consumer_commits_explicit_offsets_and_seeks(bus: Bus, unique: Unique) -> None:
    topic, group = unique("seek"), unique("writer")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(f"r{i}".encode()) for i in range(4)])
    tp = TopicPartition(topic, 0)
    with bus.consumer(group, [topic]) as consumer:
        assert [r.offset for r in poll_until(consumer, 4)] == [0, 1, 2, 3]
        consumer.commit({tp: 2})
        assert bus.committed(group) == {tp: 2}
        consumer.seek(tp, 1)
        assert [r.offset for r in poll_until(consumer, 3)] == [1, 2, 3]
    assert bus.committed(group) == {tp: 2}  # seeking commits nothing


def test_consumer_starts_at_the_low_watermark_without_committed_offsets(
    bus: Bus, unique: Unique
) -> None:
    topic, group = unique("fresh"), unique("writer")
    bus.create_topic(topic, partitions=1)
    append(bus, topic, [Message(b"first"), Message(b"second")])
    with bus.consumer(group, [topic]) as consumer:
        assert [r.value for r in poll_until(consumer, 2)] == [b"first", b"second"]
        consumer.commit()
    assert bus.committed(group)[TopicPartition(topic, 0)] == 2


# -- lifecycle ----------------------------------------------------------------------------


def test_flush_and_close(bus: Bus, unique: Unique) -> None:
    topic = unique("close")
    future = bus.append(topic, [Message(b"v", key=b"k")])
    bus.flush(timeout=WAIT_S)
    assert future.done()
    assert len(future.result()) == 1
    bus.close()
    bus.close()  # idempotent
    with pytest.raises(BusClosed):
        bus.append(topic, [Message(b"v")])
    with pytest.raises(BusClosed):
        bus.read(topic, 0, 0)


def test_read_only_bus_reads_but_does_not_write(
    open_buses: Callable[..., Bus], unique: Unique
) -> None:
    writer = open_buses()
    topic, group = unique("read-only"), unique("writer")
    writer.create_topic(topic, partitions=1)
    append(writer, topic, [Message(b"one")])
    writer.commit(group, {TopicPartition(topic, 0): 1})
    writer.close()  # group offsets reach other processes when persisted (at the latest here)

    reader = open_buses(read_only=True)
    assert [r.value for r in reader.read(topic, 0, 0)] == [b"one"]
    assert reader.committed(group) == {TopicPartition(topic, 0): 1}
    with pytest.raises(InvalidArgument):
        reader.append(topic, [Message(b"two")])
    with pytest.raises(InvalidArgument):
        reader.create_topic(unique("new"))
    with pytest.raises(InvalidArgument):
        reader.commit(group, {TopicPartition(topic, 0): 0})
