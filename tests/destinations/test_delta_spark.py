"""Spark with Delta Lake's own reader (delta-spark 4.4.0, the jars headwater.jvm.maven fetches)
reads a table headwater wrote with delta-rs: rows, types, partition pruning, an added column,
a MERGEd table, and the history; then Spark appends as another writer, and headwater commits
its next batch on top. Spark runs in a process of its own, as another team's job would (the
test session's SparkSession has no Delta jars)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from headwater.destinations import Column, TableSchema, open_destination
from headwater.destinations.base import ORDER_COLUMN
from headwater.destinations.delta.client import DeltaDestination
from headwater.destinations.types import ColumnType as T
from headwater.jvm.maven import DELTA_SPARK, classpath, fetch
from headwater.pipeline.config import DestinationConfig
from headwater.testing.warehouse import delta_query

pytestmark = pytest.mark.slow

SPARK_JOB = """
import json, sys
from pyspark.sql import SparkSession
root, jars = sys.argv[1], sys.argv[2]
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.jars", jars)
    .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
    .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.sql.session.timeZone", "UTC")
    .getOrCreate()
)
events = spark.read.format("delta").load(f"{root}/events")
day = events.where("event_date = DATE'2026-11-29'")
out = {
    "count": events.count(),
    "types": {f.name: f.dataType.simpleString() for f in events.schema.fields},
    "day": sorted(r.id for r in day.select("id").collect()),
    "names": sorted((r.id, r.name) for r in events.where("name IS NOT NULL").collect()),
    "files": [len(events.inputFiles()), len(day.inputFiles())],  # pruned by partition
    "users": sorted(tuple(r) for r in spark.read.format("delta").load(f"{root}/users").collect()),
    "history": [
        r.operation for r in spark.sql(f"DESCRIBE HISTORY delta.`{root}/events`").collect()
    ],
}
another = "id long, _timestamp timestamp, name string, event_date date"
spark.createDataFrame([(100, None, "spark", None)], another) \\
    .write.format("delta").mode("append").save(f"{root}/events")
print(json.dumps(out))
spark.stop()
"""

DAY1 = datetime(2026, 11, 28, 12, tzinfo=UTC)
DAY2 = datetime(2026, 11, 29, 12, tzinfo=UTC)


def test_spark_reads_what_headwater_wrote_and_headwater_writes_after_spark(
    tmp_path: Path,
) -> None:
    jars = fetch(DELTA_SPARK)
    root = tmp_path / "lake"
    config = DestinationConfig(id="lake", type="delta", path=str(root))
    d = open_destination(config, tmp_path)
    assert isinstance(d, DeltaDestination)
    cols = {"id": Column("id", T.INT64), "_timestamp": Column("_timestamp", T.TIMESTAMP)}
    events = TableSchema("events", cols)
    d.ensure_table(events)
    at = pa.timestamp("us", tz="UTC")
    rows = pa.table({"id": pa.array([1, 2, 3]), "_timestamp": pa.array([DAY1, DAY2, DAY2], at)})
    d.write_batch("lake", 0, {"events": rows})
    named = TableSchema("events", {**cols, "name": Column("name", T.STRING)})
    d.ensure_table(named)
    rows2 = rows.append_column("name", pa.array(["a", None, "c"])).set_column(
        0, "id", pa.array([4, 5, 6])
    )
    d.write_batch("lake", 1, {"events": rows2})
    keyed = open_destination(config.model_copy(update={"primary_key": ["k"]}), tmp_path)
    users = TableSchema("users", {"k": Column("k", T.INT64), "v": Column("v", T.STRING)}, ("k",))
    keyed.ensure_table(users)
    order = pa.array([0, 1, 2], pa.int64())
    batch = pa.table({"k": pa.array([1, 2, 1]), "v": ["x", "y", "z"], ORDER_COLUMN: order})
    keyed.write_batch("lake-users", 0, {"users": batch})

    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    job = subprocess.run(
        [sys.executable, "-c", SPARK_JOB, str(root), classpath(jars).replace(":", ",")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    seen = json.loads(job.stdout.strip().splitlines()[-1])
    assert seen["count"] == 6
    assert seen["types"] == {
        "id": "bigint",
        "_timestamp": "timestamp",
        "event_date": "date",
        "name": "string",
    }
    assert seen["day"] == [2, 3, 5, 6]
    assert seen["files"] == [4, 2]  # a file per batch and day; the day's query reads its own
    assert seen["names"] == [[4, "a"], [6, "c"]]
    assert seen["users"] == [[1, "z"], [2, "y"]]
    assert seen["history"] == ["WRITE", "ADD COLUMN", "WRITE", "CREATE TABLE"]

    # Spark appended a row as another writer: headwater's next batch goes on top of it
    assert d.write_batch("lake", 2, {"events": rows2.set_column(0, "id", pa.array([7, 8, 9]))})
    got = delta_query(d, "SELECT id FROM events ORDER BY id")
    assert [r[0] for r in got] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 100]
