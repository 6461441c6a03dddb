"""Reading the log from Spark.

``format("headwater")`` (registered by :func:`register`, which every session headwater builds
runs) reads either bus backend; its rows have the column layout of Spark's own Kafka source, so
where Spark's Kafka connector is on the classpath and the bus is Kafka, :func:`read_stream` uses
the connector instead.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from headwater.bus.layout import SCHEMA_DDL
from headwater.pipeline.source.options import RANGES
from headwater.pipeline.source.reader import RANGES_SCHEMA_DDL, SOURCE_NAME, HeadwaterSource

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from headwater.config.model import HeadwaterConfig

KAFKA_PROVIDER = "org.apache.spark.sql.kafka010.KafkaSourceProvider"


def register(spark: SparkSession) -> None:
    """Make ``format("headwater")`` available on ``spark``."""
    spark.dataSource.register(HeadwaterSource)


def kafka_connector_available(spark: SparkSession) -> bool:
    """Whether Spark's official Kafka source is on the classpath."""
    jvm = spark.sparkContext._jvm  # py4j: the only way to ask the JVM
    assert jvm is not None
    try:
        jvm.java.lang.Class.forName(
            KAFKA_PROVIDER, False, jvm.java.lang.Thread.currentThread().getContextClassLoader()
        )
    except Exception:  # py4j wraps ClassNotFoundException
        return False
    return True


def read_stream(
    spark: SparkSession,
    config: HeadwaterConfig,
    topics: list[str] | None = None,
    pattern: str | None = None,
    max_records_per_trigger: int | None = None,
    starting_offsets: str = "earliest",
    ranges_of: str | None = None,
    also: list[tuple[HeadwaterConfig, list[str], str]] | None = None,
) -> DataFrame:
    """A streaming DataFrame over ``topics`` (or the topics ``pattern`` matches). With
    ``ranges_of`` (a name for the bus), headwater's source gives one row per task's range of
    records (``RANGES_SCHEMA_DDL``) for a consumer that reads them itself; Spark's Kafka
    connector, when it is used, always gives the records. ``also``: more topics on other buses
    (config, topic names, bus name) read by the same source (headwater's source only)."""
    if (topics is None) == (pattern is None):
        raise ValueError("give exactly one of topics or pattern")
    if uses_kafka_connector(spark, config):
        if also:
            raise ValueError("Spark's Kafka connector reads one bus: no other topics")
        kafka = config.bus.kafka
        reader = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
            .option("startingOffsets", starting_offsets)
            .option("failOnDataLoss", "false")
            .option("includeHeaders", "true")
            .options(**kafka.connector)
        )
        if topics is not None:
            reader = reader.option("subscribe", ",".join(topics))
        else:
            assert pattern is not None
            reader = reader.option("subscribePattern", connector_pattern(pattern, config))
        if max_records_per_trigger is not None:
            reader = reader.option("maxOffsetsPerTrigger", str(max_records_per_trigger))
        return reader.load()
    reader = (
        spark.readStream.format(SOURCE_NAME)
        .option("config", config.model_dump_json())
        .option("startingOffsets", starting_offsets)
    )
    if topics is not None:
        reader = reader.option("topics", ",".join(topics))
    else:
        reader = reader.option("topicPattern", pattern)
    if max_records_per_trigger is not None:
        reader = reader.option("maxRecordsPerTrigger", str(max_records_per_trigger))
    if ranges_of is not None:
        reader = reader.option("layout", RANGES).option("busName", ranges_of)
    if also:
        feeds = [
            {"config": c.model_dump(mode="json"), "topics": t, "busName": b} for c, t, b in also
        ]
        reader = reader.option("alsoRead", json.dumps(feeds))
    return reader.load()


def connector_pattern(pattern: str, config: HeadwaterConfig) -> str:
    """``pattern`` for the connector's ``subscribePattern`` (a Java regex matched in full, as
    headwater's source matches it), never matching internal topics: those of headwater
    (``headwater-...``) and the failed store's, as with headwater's source."""
    from headwater.pipeline.source.offsets import INTERNAL_PREFIX

    excluded = f"{re.escape(INTERNAL_PREFIX)}|{re.escape(config.pipeline.failed_topic)}$"
    return f"(?!{excluded})(?:{pattern})"


def uses_kafka_connector(spark: SparkSession, config: HeadwaterConfig) -> bool:
    """Whether ``read_stream`` reads ``config``'s bus with Spark's Kafka connector."""
    return config.bus.backend == "kafka" and kafka_connector_available(spark)


__all__ = [
    "KAFKA_PROVIDER",
    "RANGES_SCHEMA_DDL",
    "SCHEMA_DDL",
    "SOURCE_NAME",
    "kafka_connector_available",
    "read_stream",
    "register",
    "uses_kafka_connector",
]
