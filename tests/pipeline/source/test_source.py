"""The ``headwater`` Spark source over both bus backends: the Kafka source's column layout and
values, micro-batches capped by maxRecordsPerTrigger under Trigger.AvailableNow, restarts from a
checkpoint, topics appearing after the query started, and startingOffsets.

On Apache Kafka, batch reads go through headwater's source and streaming reads through Spark's
Kafka connector (``read_stream`` picks it when the bus is Kafka and the connector is on the
session's classpath, as the test session's is): the two must behave alike.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from headwater.bus import Bus, open_bus
from headwater.bus.records import Message
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.source import (
    kafka_connector_available,
    read_stream,
    uses_kafka_connector,
)

KAFKA_TEST_CLIENT: dict[str, Any] = {"consumer": {"session.timeout.ms": 6000}, "timeout_s": 15.0}
COLUMNS = ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType", "headers"]


@pytest.fixture(
    params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)],
)
def config(request: pytest.FixtureRequest, tmp_path: Path) -> HeadwaterConfig:
    if request.param == "embedded":
        bus: dict[str, Any] = {"backend": "embedded", "embedded": {"default_partitions": 2}}
    else:
        broker = request.getfixturevalue("kafka_broker")
        bus = {
            "backend": "kafka",
            "kafka": {
                **KAFKA_TEST_CLIENT,
                "bootstrap_servers": broker.bootstrap_servers,
                "default_partitions": 2,
            },
        }
    return HeadwaterConfig.model_validate({"data_dir": str(tmp_path), "bus": bus})


@pytest.fixture
def bus(config: HeadwaterConfig) -> Iterator[Bus]:
    with open_bus(config) as b:
        yield b


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def put(bus: Bus, topic: str, messages: list[Message]) -> None:
    """Append one record per request, each durable before the next (a known order)."""
    for m in messages:
        bus.append(topic, [m]).result(timeout=30)
    bus.flush(30)


def msg(i: int, partition: int | None = None) -> Message:
    return Message(
        b"value-%d" % i,
        key=None if i % 3 == 0 else b"key-%d" % i,
        headers=(("event-id", b"e-%d" % i), ("bin", b"\x00\xff")),
        timestamp=1_714_564_800_000 + i,
        partition=partition,
    )


def batch_frame(spark: Any, config: HeadwaterConfig, **options: str) -> Any:
    reader = spark.read.format("headwater").option("config", config.model_dump_json())
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def test_batch_read_has_the_kafka_layout_and_every_value(spark, config, bus, prefix) -> None:
    topic = f"{prefix}-a"
    bus.create_topic(topic, partitions=2)
    put(bus, topic, [msg(i, partition=i % 2) for i in range(6)])

    df = batch_frame(spark, config, topics=topic)
    assert df.columns == COLUMNS
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "binary",
        "binary",
        "string",
        "int",
        "bigint",
        "timestamp",
        "int",
        "array<struct<key:string,value:binary>>",
    ]
    rows = sorted(df.collect(), key=lambda r: (r.partition, r.offset))
    assert [(r.partition, r.offset) for r in rows] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    by_value = {bytes(r.value): r for r in rows}
    for i in range(6):
        r = by_value[b"value-%d" % i]
        assert r.key == (None if i % 3 == 0 else b"key-%d" % i)
        assert r.topic == topic and r.timestampType == 0
        assert r.timestamp.replace(tzinfo=UTC) == datetime.fromtimestamp(
            (1_714_564_800_000 + i) / 1000, UTC
        )
        assert [(h.key, bytes(h.value)) for h in r.headers] == [
            ("event-id", b"e-%d" % i),
            ("bin", b"\x00\xff"),
        ]


def test_batch_read_by_pattern_and_explicit_offsets(spark, config, bus, prefix) -> None:
    for name in ("x", "y"):
        bus.create_topic(f"{prefix}-{name}", partitions=1)
        put(bus, f"{prefix}-{name}", [msg(i) for i in range(4)])
    df = batch_frame(
        spark,
        config,
        topicPattern=f"{prefix}-.*",
        startingOffsets=f'{{"{prefix}-x": {{"0": 2}}}}',
        endingOffsets=f'{{"{prefix}-y": {{"0": 1}}}}',
    )
    got = sorted((r.topic[-1], r.offset) for r in df.select("topic", "offset").collect())
    # x from 2 to its end (latest for unnamed partitions is the end), y from 0 to 1
    assert got == [("x", 2), ("x", 3), ("y", 0)]


class Collector:
    """A foreachBatch sink that keeps what each micro-batch held."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int, int]]] = []

    def __call__(self, df: Any, batch_id: int) -> None:
        self.batches.append(
            sorted((r.topic, r.partition, r.offset) for r in df.select(*COLUMNS[2:5]).collect())
        )

    @property
    def rows(self) -> list[tuple[str, int, int]]:
        return sorted(r for b in self.batches for r in b)


def available_now(spark, config, checkpoint: Path, sink: Collector, **kw: Any) -> None:
    frame = read_stream(spark, config, **kw)
    query = (
        frame.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)


def test_available_now_caps_micro_batches_and_resumes(spark, config, bus, prefix, tmp_path):
    topic = f"{prefix}-s"
    bus.create_topic(topic, partitions=2)
    put(bus, topic, [msg(i, partition=i % 2) for i in range(10)])
    checkpoint = tmp_path / "checkpoint"

    first = Collector()
    available_now(spark, config, checkpoint, first, topics=[topic], max_records_per_trigger=4)
    assert [len(b) for b in first.batches if b] == [4, 4, 2]
    # the cap is shared fairly by the two partitions
    assert {p for _, p, _ in first.batches[0]} == {0, 1}
    assert first.rows == sorted((topic, i % 2, i // 2) for i in range(10))

    put(bus, topic, [msg(i, partition=i % 2) for i in range(10, 15)])
    second = Collector()
    available_now(spark, config, checkpoint, second, topics=[topic], max_records_per_trigger=4)
    assert second.rows == sorted((topic, i % 2, i // 2) for i in range(10, 15))


def test_starting_offsets_latest_reads_only_new_records(spark, config, bus, prefix, tmp_path):
    topic = f"{prefix}-l"
    bus.create_topic(topic, partitions=1)
    put(bus, topic, [msg(i) for i in range(3)])
    sink = Collector()
    frame = read_stream(spark, config, topics=[topic], starting_offsets="latest")
    query = (
        frame.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        wait_for(lambda: query.lastProgress is not None, "the first trigger")
        put(bus, topic, [msg(i) for i in range(3, 5)])
        wait_for(lambda: len(sink.rows) >= 2, "the new records")
    finally:
        query.stop()
    assert sink.rows == [(topic, 0, 3), (topic, 0, 4)]


def test_a_pattern_picks_up_topics_created_later_but_not_internal_ones(
    spark, config, bus, prefix, tmp_path
):
    bus.create_topic(f"{prefix}-one", partitions=1)
    put(bus, f"{prefix}-one", [msg(0)])
    sink = Collector()
    frame = read_stream(spark, config, pattern=f"{prefix}-.*|headwater-{prefix}")
    query = (
        frame.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        wait_for(lambda: len(sink.rows) == 1, "the first topic's record")
        bus.create_topic(f"headwater-{prefix}", partitions=1)
        put(bus, f"headwater-{prefix}", [msg(1)])
        bus.create_topic(f"{prefix}-two", partitions=1)
        put(bus, f"{prefix}-two", [msg(2), msg(3)])
        wait_for(lambda: len(sink.rows) == 3, "the new topic's records")
    finally:
        query.stop()
    assert sink.rows == [(f"{prefix}-one", 0, 0), (f"{prefix}-two", 0, 0), (f"{prefix}-two", 0, 1)]


def test_the_kafka_bus_is_read_by_sparks_connector_with_the_same_columns(spark, config) -> None:
    assert kafka_connector_available(spark)
    assert uses_kafka_connector(spark, config) == (config.bus.backend == "kafka")
    frame = read_stream(spark, config, topics=["anything"])
    assert frame.isStreaming and frame.columns == COLUMNS
    plan = frame._jdf.queryExecution().logical().toString()  # py4j: the source Spark chose
    chosen = "kafka" if config.bus.backend == "kafka" else "headwater"
    assert f"format: {chosen}," in plan, plan


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
