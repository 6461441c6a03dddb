"""The sink's Spark job: a batch of events in four partitions, routed to two
tables, run through the batch's program by the executors, staged (in chunks) and committed by
the driver lands every row once in DuckDB and PostgreSQL; a task that fails midway (after
staging some chunks) fails the job, the job's staging is discarded, and the batch run again
lands every row once with none of the failed run's."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame

from headwater.config.model import HeadwaterConfig
from headwater.destinations import Destination, open_destination
from headwater.pipeline import sink
from headwater.pipeline.plan import BatchPlan, widen_tables
from headwater.pipeline.sink import SinkWriter
from headwater.testing.pipeline import SOURCE_SCHEMA, process, rows_of, source_table
from headwater.testing.warehouse import delta_leftovers, query, scratch_destination

ROWS = 3000
TEMPLATE = "{{ kind }}"


def values() -> list[dict[str, Any]]:
    """Every third event a page, the rest events."""
    out = []
    for i in range(ROWS):
        at = datetime.fromtimestamp(1_700_000_000 + i, UTC).isoformat()
        if i % 3 == 0:
            out.append({"kind": "pages", "id": i, "url": f"/p/{i}"})
        else:
            out.append(
                {
                    "kind": "events",
                    "id": i,
                    "name": f"n{i}",
                    "ok": i % 2 == 0,
                    "x": i * 0.5 + 0.25,
                    "seen_at": at,
                }
            )
    return out


def frame(spark: Any) -> DataFrame:
    return spark.createDataFrame(rows_of(values()), SOURCE_SCHEMA).repartition(4)


@pytest.fixture(params=["duckdb", "postgres", "delta"])
def setup(
    request: pytest.FixtureRequest, tmp_path: Path, spark: Any
) -> Iterator[tuple[HeadwaterConfig, Destination, BatchPlan]]:
    dest = scratch_destination(request, str(request.param), tmp_path)
    dest["table_name_template"] = TEMPLATE
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": [dest]}}
    )
    planned = process(source_table(values()[:30]), dest, path=tmp_path).plan
    d = open_destination(config.pipeline.destinations[0], config.data_dir)
    widen_tables(d, planned.tables.values())
    yield config, d, planned
    d.close()


def landed(d: Destination) -> dict[str, list[int]]:
    return {t: [r[0] for r in query(d, f"SELECT id FROM {t} ORDER BY id")] for t in EXPECTED}


EXPECTED = {
    "events": [i for i in range(ROWS) if i % 3],
    "pages": [i for i in range(ROWS) if i % 3 == 0],
}


def commit(d: Destination, config: HeadwaterConfig, planned: BatchPlan, parts: list) -> bool:
    schemas = {tp.schema.name: tp.schema for tp in planned.tables.values()}
    return d.commit_staged(config.pipeline.destinations[0].id, 0, parts, schemas)


def test_every_row_lands_once(
    spark: Any, setup: tuple[HeadwaterConfig, Destination, BatchPlan]
) -> None:
    config, d, planned = setup
    dest = config.pipeline.destinations[0]
    with small_arrow_batches(spark):  # tasks get batches of 100 rows, stage every 200 or more
        result = sink.run(frame(spark), config, dest, 0, planned.program, chunk_rows=200)
    parts = result.parts
    assert sum(p.rows for p in parts) == ROWS
    assert result.summary.tables == {"events": 2000, "pages": 1000}
    assert result.summary.novel == 0 and result.summary.failed == 0
    assert len({p.task for p in parts}) == 4  # one task per partition, each staged ...
    assert len(parts) > 8 and max(p.rows for p in parts) < 400  # ... in bounded chunks
    assert landed(d) == {"events": [], "pages": []}  # nothing visible before the commit
    assert commit(d, config, planned, parts) is True
    assert landed(d) == EXPECTED
    got = query(d, "SELECT name, ok, x, seen_at FROM events WHERE id = 7")
    assert [(n, ok, float(x), at.timestamp()) for n, ok, x, at in got] == [
        ("n7", False, 3.75, 1_700_000_007.0)
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
    """The sink's tasks, failing partition 2 after its fourth Arrow batch while the marker
    file exists (after it staged chunks of its own), once partition 3, which runs beside it,
    has finished (staged its parts and returned its message)."""

    marker = ""  # set by the test before the class is pickled (by value) to the workers

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Any:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else -1
        message = super().write(self._failing(iterator, Path(self.marker), partition))
        if partition == 3:
            Path(f"{self.marker}.3-done").touch()
        return message

    @staticmethod
    def _failing(
        iterator: Iterator[pa.RecordBatch], marker: Path, partition: int
    ) -> Iterator[pa.RecordBatch]:
        for i, batch in enumerate(iterator):
            yield batch
            if i == 3 and partition == 2 and marker.exists():
                done = Path(f"{marker}.3-done")
                deadline = time.monotonic() + 60
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # (a condition with a deadline: partition 3 finished)
                raise RuntimeError("injected task failure")


def test_a_failed_task_leaves_no_row_and_the_rerun_lands_each_once(
    spark: Any, setup: tuple[HeadwaterConfig, Destination, BatchPlan], tmp_path: Path
) -> None:
    """Local mode runs a task once (no ``spark.task.maxFailures`` there), so the failed task
    fails the job: its staging is discarded (the failed task's by the task, the finished
    tasks' by ``sink.run``), and the batch runs again, as the writer retries it. (A task
    cancelled while it stages may still stage after that: such parts are in no message, so
    never committed, and the writer's ``clean_staging`` removes them when it starts.)"""
    import pyspark.cloudpickle as cloudpickle

    config, d, planned = setup
    dest = config.pipeline.destinations[0]
    marker = tmp_path / "fail-once"
    marker.touch()
    FailingSinkWriter.marker = str(marker)
    here = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(here)  # the workers cannot import the test module
    try:
        with small_arrow_batches(spark), pytest.raises(Exception, match="injected task failure"):
            sink.run(
                frame(spark),
                config,
                dest,
                0,
                planned.program,
                chunk_rows=100,
                writer=FailingSinkWriter,
            )
        assert landed(d) == {"events": [], "pages": []}
        assert Path(f"{marker}.3-done").exists()  # a finished task had staged its parts ...
        assert staging_left(d) == []  # ... which sink.run discarded with the failed task's
        marker.unlink()
        result = sink.run(frame(spark), config, dest, 0, planned.program, chunk_rows=400)
    finally:
        cloudpickle.unregister_pickle_by_value(here)
    assert commit(d, config, planned, result.parts) is True
    assert landed(d) == EXPECTED
    assert staging_left(d) == []


def staging_left(d: Destination) -> list[str]:
    if d.kind == "postgres":
        from headwater.destinations.postgres.client import STAGING_SCHEMA

        rows = query(d, f"SELECT tablename FROM pg_tables WHERE schemaname = '{STAGING_SCHEMA}'")
        return [str(r[0]) for r in rows]
    if d.kind == "delta":
        return delta_leftovers(d)
    folder: Path = d.staging  # type: ignore[attr-defined]
    return [str(p) for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
