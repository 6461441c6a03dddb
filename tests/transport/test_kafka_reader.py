"""The Kafka reader: records of a real external Kafka broker land once on the embedded log, in
order per source partition, with their values, keys and positions; a restart resumes from the
reader's own offsets, also when its state file is behind the log; ``start: latest`` skips what
was there before; and a reader SIGKILLed again and again while it appends leaves every record
exactly once."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.transport.reader_harness import (
    BUS_CONFIG,
    LAUNCHERS,
    Killed,
    Running,
    dies_on_save,
    kill,
    read_all,
    start_child,
    wait_until,
)

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.testing.kafka import KafkaCluster
from headwater.transport.config import KafkaReaderConfig
from headwater.transport.kafka.reader import KafkaReader, parse_position, record_change
from headwater.transport.message import Change, Mode, Op, decode
from headwater.transport.reader import read_json, read_status

READER = "kafka"


# -- helpers ----------------------------------------------------------------------------------


def make_topic(broker: KafkaCluster, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"ext-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions)])
    futures[name].result(timeout=30)
    return name


def produce(
    broker: KafkaCluster, topic: str, records: list[tuple[int, bytes | None, bytes | None]]
) -> None:
    """Produce ``(partition, key, value)`` records in order and wait until they are stored."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 5})
    for partition, key, value in records:
        producer.produce(topic, value=value, key=key, partition=partition)
        producer.poll(0)
    assert producer.flush(30) == 0


def numbered(partitions: int, start: int, count: int) -> list[tuple[int, bytes | None, bytes]]:
    """``count`` JSON records per partition numbered from ``start`` (a record's number is its
    offset); every third one has a key."""
    return [
        (p, f"k{i}".encode() if i % 3 == 0 else None, orjson.dumps({"p": p, "i": i}))
        for i in range(start, start + count)
        for p in range(partitions)
    ]


def make_config(broker: KafkaCluster, topic: str, **fields: Any) -> KafkaReaderConfig:
    body = {
        "id": READER,
        "type": "kafka",
        "bootstrap_servers": broker.bootstrap_servers,
        "topics": [topic],
    }
    return KafkaReaderConfig.model_validate({**body, **fields})


def by_source(bus: EmbeddedBus, topic: str) -> dict[int, list[Change]]:
    """The changes of an external topic on the log by source partition, in log order; each
    source partition must be in one partition of the log."""
    out: dict[int, list[Change]] = {}
    where: dict[int, int] = {}
    info = next((t for t in bus.topics() if t.name == f"cdc.{READER}.{topic}"), None)
    for partition in range(info.partitions if info else 0):
        for record in read_all(bus, info.name, partition):  # type: ignore[union-attr]
            change, mode = decode(record)
            assert mode is Mode.SYNC and change.namespace == topic
            where_ = parse_position(change.position)
            assert where_ is not None and where_[0] == topic
            source = where_[1]
            assert where.setdefault(source, partition) == partition, "a source partition is split"
            out.setdefault(source, []).append(change)
    return out


def offsets(changes: dict[int, list[Change]]) -> dict[int, list[int]]:
    return {
        p: [parse_position(c.position)[2] for c in cs]  # type: ignore[index]
        for p, cs in sorted(changes.items())
    }


def count(bus: EmbeddedBus, topic: str) -> int:
    return sum(len(cs) for cs in by_source(bus, topic).values())


def saved_offsets(state: Path) -> dict[str, int]:
    try:
        return dict(read_json(state / "state.json").get("offsets", {}))
    except ValueError:  # the child is replacing the file
        return {}


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    with EmbeddedBus(tmp_path / "log", BUS_CONFIG) as b:
        yield b


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


# -- pure functions ---------------------------------------------------------------------------


def test_record_change_forms() -> None:
    obj = record_change("t", 1, 7, None, b'{"a": 1}', 5)
    assert (obj.op, obj.namespace, obj.data, obj.key, obj.position) == (
        Op.INSERT,
        "t",
        {"a": 1},
        None,
        "t/1/7",
    )
    assert record_change("t", 0, 0, b"k", b"[1]", 5).data == {"value": "[1]"}
    assert record_change("t", 0, 0, b"k", b"[1]", 5).key == {"key": "k"}
    binary = record_change("t", 0, 0, b"\xff", b"\x00\xff", 5)
    assert binary.data == {"value": "AP8=", "encoding": "base64"}
    assert binary.key == {"key": "/w==", "encoding": "base64"}
    tombstone = record_change("t", 0, 0, b"k", None, 5)
    assert (tombstone.op, tombstone.data, tombstone.key) == (Op.DELETE, None, {"key": "k"})
    assert parse_position("a.b-c/2/10") == ("a.b-c", 2, 10)
    assert parse_position("nope") is None


# -- against the broker -----------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.slow
def test_records_land_once_with_keys_and_positions(
    kafka_broker: KafkaCluster, bus: EmbeddedBus, state: Path
) -> None:
    topic = make_topic(kafka_broker, 1)
    records: list[tuple[int, bytes | None, bytes | None]] = [
        (0, None, b'{"a": 1, "b": [true, null]}'),
        (0, b"k1", b"[1, 2]"),
        (0, None, "héllo".encode()),
        (0, b"\xff", b"\x00\xff"),
        (0, b"k2", None),
    ]
    produce(kafka_broker, topic, records)
    run = Running(KafkaReader(make_config(kafka_broker, topic), bus, state))
    try:
        wait_until(lambda: count(bus, topic) >= 5, "5 changes")
    finally:
        run.stop()
    changes = by_source(bus, topic)[0]
    assert [(c.op, c.key, c.data, c.position) for c in changes] == [
        (Op.INSERT, None, {"a": 1, "b": [True, None]}, f"{topic}/0/0"),
        (Op.INSERT, {"key": "k1"}, {"value": "[1, 2]"}, f"{topic}/0/1"),
        (Op.INSERT, None, {"value": "héllo"}, f"{topic}/0/2"),
        (
            Op.INSERT,
            {"key": "/w==", "encoding": "base64"},
            {"value": "AP8=", "encoding": "base64"},
            f"{topic}/0/3",
        ),
        (Op.DELETE, {"key": "k2"}, None, f"{topic}/0/4"),
    ]
    assert read_json(state / "state.json")["offsets"] == {f"{topic}/0": 5}
    status = read_status(state)
    assert status["namespaces"][topic]["phase"] == "sync"
    assert status["running"] is False


@pytest.mark.kafka
@pytest.mark.slow
def test_restart_resumes_from_its_offsets(
    kafka_broker: KafkaCluster, bus: EmbeddedBus, state: Path
) -> None:
    topic = make_topic(kafka_broker, 3)
    produce(kafka_broker, topic, numbered(3, 0, 30))
    config = make_config(kafka_broker, topic, batch_records=16)
    run = Running(KafkaReader(config, bus, state))
    try:
        wait_until(lambda: count(bus, topic) == 90, "90 changes")
    finally:
        run.stop()
    produce(kafka_broker, topic, numbered(3, 30, 20))
    run = Running(KafkaReader(config, bus, state))
    try:
        wait_until(lambda: count(bus, topic) >= 150, "150 changes")
    finally:
        run.stop()
    changes = by_source(bus, topic)
    assert offsets(changes) == {p: list(range(50)) for p in range(3)}
    assert all(c.data == {"p": p, "i": i} for p, cs in changes.items() for i, c in enumerate(cs))
    assert read_json(state / "state.json")["offsets"] == {f"{topic}/{p}": 50 for p in range(3)}


@pytest.mark.kafka
@pytest.mark.slow
def test_state_behind_the_log_gives_no_duplicate(
    kafka_broker: KafkaCluster, bus: EmbeddedBus, state: Path
) -> None:
    """A reader killed after a durable append but before saving its offsets: on start it takes
    them from the log."""
    topic = make_topic(kafka_broker, 2)
    produce(kafka_broker, topic, numbered(2, 0, 40))
    config = make_config(kafka_broker, topic, batch_records=7)
    reader = KafkaReader(config, bus, state)
    dies_on_save(reader, 3)  # on start, then after the first two batches
    run = Running(reader)
    wait_until(lambda: run.error is not None, "the reader to die")
    with pytest.raises(Killed):
        run.stop()
    assert count(bus, topic) == 21 and sum(saved_offsets(state).values()) == 14
    produce(kafka_broker, topic, numbered(2, 40, 1))
    run = Running(KafkaReader(config, bus, state))
    try:
        wait_until(lambda: count(bus, topic) >= 82, "every record")
    finally:
        run.stop()
    assert offsets(by_source(bus, topic)) == {p: list(range(41)) for p in range(2)}
    assert saved_offsets(state) == {f"{topic}/{p}": 41 for p in range(2)}


@pytest.mark.kafka
@pytest.mark.slow
def test_start_latest_skips_what_was_there(
    kafka_broker: KafkaCluster, bus: EmbeddedBus, state: Path
) -> None:
    topic = make_topic(kafka_broker, 2)
    produce(kafka_broker, topic, numbered(2, 0, 10))
    run = Running(KafkaReader(make_config(kafka_broker, topic, start="latest"), bus, state))
    try:
        wait_until(lambda: len(saved_offsets(state)) == 2, "the start offsets saved")
        assert saved_offsets(state) == {f"{topic}/0": 10, f"{topic}/1": 10}
        produce(kafka_broker, topic, numbered(2, 10, 3))
        wait_until(lambda: count(bus, topic) >= 6, "the 6 new records")
    finally:
        run.stop()
    assert offsets(by_source(bus, topic)) == {p: [10, 11, 12] for p in range(2)}


@pytest.mark.kafka
@pytest.mark.slow
def test_topic_made_later_is_picked_up(
    kafka_broker: KafkaCluster, bus: EmbeddedBus, state: Path
) -> None:
    later = f"ext-{uuid.uuid4().hex[:10]}"
    run = Running(KafkaReader(make_config(kafka_broker, later), bus, state))
    try:
        wait_until(lambda: read_status(state).get("running") is True, "the reader running")
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
        admin.create_topics([NewTopic(later, num_partitions=1)])[later].result(timeout=30)
        produce(kafka_broker, later, numbered(1, 0, 3))
        wait_until(lambda: count(bus, later) >= 3, "the records of the new topic")
    finally:
        run.stop()
    assert offsets(by_source(bus, later)) == {0: [0, 1, 2]}


# -- SIGKILL ----------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigkill_while_appending_loses_and_repeats_nothing(
    launcher: str, kafka_broker: KafkaCluster, tmp_path: Path
) -> None:
    """The reader in a child process, SIGKILLed four times while it appends (more records are
    produced between runs), then left to read everything: the log holds every record once, in
    order per source partition."""
    rng = random.Random(12)
    data = tmp_path / "data"
    state = data / "transport" / READER
    topic = make_topic(kafka_broker, 3)
    config = make_config(kafka_broker, topic, batch_records=200)
    per_partition = 15_000
    produce(kafka_broker, topic, numbered(3, 0, per_partition))
    kills = 0
    for round_ in range(4):
        child = start_child(launcher, data, config)
        try:
            target = sum(saved_offsets(state).values()) + rng.randint(1_000, 6_000)
            wait_until(lambda t=target: sum(saved_offsets(state).values()) >= t, f"round {round_}")
        finally:
            kill(child)
        kills += 1
        produce(kafka_broker, topic, numbered(3, per_partition, 1_000))
        per_partition += 1_000
    child = start_child(launcher, data, config)
    try:
        wait_until(
            lambda: sum(saved_offsets(state).values()) == 3 * per_partition, "the last run", 120
        )
    finally:
        kill(child)
    assert kills >= 3
    with EmbeddedBus(data / "log", BUS_CONFIG) as bus:
        changes = by_source(bus, topic)
    assert offsets(changes) == {p: list(range(per_partition)) for p in range(3)}
    assert all(c.data == {"p": p, "i": i} for p, cs in changes.items() for i, c in enumerate(cs))
