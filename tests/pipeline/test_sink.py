"""The ``headwater_sink`` data source: a Spark frame of two tables in four partitions staged by
the executors (in chunks) and committed by the driver lands every row once in DuckDB and
PostgreSQL; a task that fails midway (after staging some chunks) fails the job, the job's staging
is discarded, and the batch run again lands every row once with none of the failed run's."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.config.model import HeadwaterConfig
from headwater.destinations import Column, Destination, TableSchema, open_destination
from headwater.destinations.types import ColumnType as T
from headwater.pipeline import sink
from headwater.pipeline.sink import SinkWriter, stage_frame
from headwater.testing.warehouse import query, scratch_destination

ROWS = 3000
TABLES = {
    "events": {
        "id": T.INT64,
        "name": T.STRING,
        "ok": T.BOOL,
        "x": T.FLOAT64,
        "seen_at": T.TIMESTAMP,
    },
    "pages": {"id": T.INT64, "url": T.STRING},
}


def frame(spark: Any) -> DataFrame:
    """``ROWS`` rows in 4 partitions: every third one a page, the rest events."""
    ids = spark.range(0, ROWS, 1, 4)
    return ids.select(
        F.when(F.col("id") % 3 == 0, F.lit("pages")).otherwise(F.lit("events")).alias("_hw_table"),
        F.col("id"),
        F.concat(F.lit("n"), F.col("id").cast("string")).alias("name"),
        (F.col("id") % 2 == 0).alias("ok"),
        (F.col("id") * 0.5).alias("x"),
        F.timestamp_seconds(F.col("id") + 1_700_000_000).alias("seen_at"),
        F.concat(F.lit("/p/"), F.col("id").cast("string")).alias("url"),
        F.col("id").alias("_hw_order"),
    )


@pytest.fixture(params=["duckdb", "postgres"])
def setup(
    request: pytest.FixtureRequest, tmp_path: Path, spark: Any
) -> Iterator[tuple[HeadwaterConfig, Destination, dict[str, TableSchema]]]:
    sink.register(spark)
    dest = scratch_destination(request, str(request.param), tmp_path)
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": [dest]}}
    )
    d = open_destination(config.pipeline.destinations[0], config.data_dir)
    schemas = {
        t: d.ensure_table(TableSchema(t, {n: Column(n, k) for n, k in cols.items()}))
        for t, cols in TABLES.items()
    }
    yield config, d, schemas
    d.close()


def columns() -> dict[str, list[str]]:
    return {t: list(cols) for t, cols in TABLES.items()}


def landed(d: Destination) -> dict[str, list[int]]:
    return {t: [r[0] for r in query(d, f"SELECT id FROM {t} ORDER BY id")] for t in TABLES}


EXPECTED = {
    "events": [i for i in range(ROWS) if i % 3],
    "pages": [i for i in range(ROWS) if i % 3 == 0],
}


def test_every_row_lands_once(
    spark: Any, setup: tuple[HeadwaterConfig, Destination, dict[str, TableSchema]]
) -> None:
    config, d, schemas = setup
    dest = config.pipeline.destinations[0]
    with small_arrow_batches(spark):  # tasks get batches of 100 rows, stage every 200 or more
        parts = stage_frame(frame(spark), config, dest, 0, columns(), chunk_rows=200)
    assert sum(p.rows for p in parts) == ROWS
    assert len({p.task for p in parts}) == 4  # one task per partition, each staged ...
    assert len(parts) > 8 and max(p.rows for p in parts) < 300  # ... in bounded chunks
    assert landed(d) == {"events": [], "pages": []}  # nothing visible before the commit
    assert d.commit_staged(dest.id, 0, parts, schemas) is True
    assert landed(d) == EXPECTED
    got = query(d, "SELECT name, ok, x, seen_at FROM events WHERE id = 7")
    assert [(n, ok, float(x), at.timestamp()) for n, ok, x, at in got] == [
        ("n7", False, 3.5, 1_700_000_007.0)
    ]
    assert d.committed(dest.id) == 0


@contextmanager
def small_arrow_batches(spark: Any) -> Iterator[None]:
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "100")
    try:
        yield
    finally:
        spark.conf.set(key, before)


class FailingSinkWriter(SinkWriter):
    """The sink's writer, failing partition 2 after its second Arrow batch while the marker
    file exists (after it staged chunks of its own)."""

    marker = ""  # set by the test before the class is pickled (by value) to the workers

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Any:
        return super().write(self._failing(iterator, Path(self.marker)))

    @staticmethod
    def _failing(iterator: Iterator[pa.RecordBatch], marker: Path) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        for i, batch in enumerate(iterator):
            yield batch
            if i == 3 and ctx is not None and ctx.partitionId() == 2 and marker.exists():
                raise RuntimeError("injected task failure")


class FailingSink(sink.HeadwaterSink):
    def writer(self, schema: Any, overwrite: bool) -> SinkWriter:
        return FailingSinkWriter(sink.SinkOptions.parse(self.options))


def test_a_failed_task_leaves_no_row_and_the_rerun_lands_each_once(
    spark: Any,
    setup: tuple[HeadwaterConfig, Destination, dict[str, TableSchema]],
    tmp_path: Path,
) -> None:
    """Local mode runs a task once (no ``spark.task.maxFailures`` there), so the failed task
    fails the job: Spark aborts it (the finished tasks' parts are discarded), and the batch runs
    again, as the writer retries it."""
    import pyspark.cloudpickle as cloudpickle

    config, d, schemas = setup
    dest = config.pipeline.destinations[0]
    marker = tmp_path / "fail-once"
    marker.touch()
    FailingSinkWriter.marker = str(marker)
    here = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(here)  # the workers cannot import the test module
    try:
        spark.dataSource.register(FailingSink)  # takes the sink's name
        with small_arrow_batches(spark), pytest.raises(Exception, match="injected task failure"):
            stage_frame(frame(spark), config, dest, 0, columns(), chunk_rows=100)
        assert landed(d) == {"events": [], "pages": []}
        # the failed task discarded its chunks, abort the finished tasks', and stage_frame
        # what tasks cancelled with the job left (cancelled tasks may still be ending)
        deadline = time.monotonic() + 30
        while staging_left(d) and time.monotonic() < deadline:
            d.clean_staging(dest.id)
            time.sleep(0.2)
        assert staging_left(d) == []
        marker.unlink()
        parts = stage_frame(frame(spark), config, dest, 0, columns(), chunk_rows=400)
    finally:
        sink.register(spark)
        cloudpickle.unregister_pickle_by_value(here)
    assert d.commit_staged(dest.id, 0, parts, schemas) is True
    assert landed(d) == EXPECTED
    assert staging_left(d) == []


def staging_left(d: Destination) -> list[str]:
    if d.kind == "postgres":
        from headwater.destinations.postgres.client import STAGING_SCHEMA

        rows = query(d, f"SELECT tablename FROM pg_tables WHERE schemaname = '{STAGING_SCHEMA}'")
        return [str(r[0]) for r in rows]
    folder: Path = d.staging  # type: ignore[attr-defined]
    return [str(p) for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
