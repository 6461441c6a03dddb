"""The pipeline over both bus backends: events on a topic of four partitions land exactly once,
the batch read by as many Spark tasks as there are partitions (each task reads its range of
records itself, from the embedded log's files), and a second run adds nothing. On Apache Kafka
the records come through Spark's Kafka connector (one task per partition, too)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest

from headwater.bus import open_bus
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.runner import Pipeline
from headwater.testing.pipeline import track_message

EVENTS = 1_200
PARTITIONS = 4
KAFKA_TEST_CLIENT: dict[str, Any] = {"consumer": {"session.timeout.ms": 6000}, "timeout_s": 15.0}


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def config(request: pytest.FixtureRequest, tmp_path: Path) -> HeadwaterConfig:
    topic = f"events-{uuid.uuid4().hex[:8]}"
    if request.param == "embedded":
        bus: dict[str, Any] = {"backend": "embedded", "embedded": {"durability": "never"}}
    else:
        broker = request.getfixturevalue("kafka_broker")
        bus = {
            "backend": "kafka",
            "kafka": {**KAFKA_TEST_CLIENT, "bootstrap_servers": broker.bootstrap_servers},
        }
    dest = {"id": "wh", "type": "duckdb", "path": str(tmp_path / "wh.duckdb"), "topics": [topic]}
    return HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "bus": bus, "pipeline": {"destinations": [dest]}}
    )


def fill(config: HeadwaterConfig, topic: str) -> None:
    with open_bus(config) as bus:
        bus.create_topic(topic, PARTITIONS)
        messages = [track_message(i) for i in range(EVENTS)]
        for start in range(0, EVENTS, 500):
            bus.append(topic, messages[start : start + 500]).result(timeout=30)
        bus.flush(30)


def test_a_four_partition_topic_lands_once_read_by_four_tasks(
    spark: Any, config: HeadwaterConfig
) -> None:
    dest = config.pipeline.destinations[0]
    assert dest.topics is not None
    fill(config, dest.topics[0])

    first = Pipeline(config, spark)
    first.run_once()
    writer = first.queries[0].writer
    writer.close()
    assert writer.written == EVENTS and writer.failed_events == 0
    assert writer.last is not None and writer.last.tasks >= PARTITIONS

    again = Pipeline(config, spark)
    again.run_once()
    again.queries[0].writer.close()
    assert again.queries[0].writer.written == 0
    assert dest.path is not None
    with duckdb.connect(str(dest.path), read_only=True) as con:
        got = con.execute(
            "select count(*), count(distinct eventn_ctx_event_id), sum(n) from events"
        ).fetchone()
    assert got == (EVENTS, EVENTS, sum(range(EVENTS)))
