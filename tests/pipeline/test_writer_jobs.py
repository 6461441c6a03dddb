"""The writer's Spark jobs per micro-batch: a batch whose fields the last batch had too needs
no separate inference pass (their probes run in the steps' own job), and gives the same rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headwater.config.model import HeadwaterConfig
from headwater.pipeline.writer import DestinationWriter
from headwater.testing.pipeline import batch
from headwater.testing.warehouse import read_rows


def jobs_of(spark: Any, group: str, run: Any) -> int:
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        run()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return len(sc.statusTracker().getJobIdsForGroup(group))


def test_known_fields_are_probed_in_the_steps_job(spark: Any, tmp_path: Path) -> None:
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path), "pipeline": {"destinations": [{"id": "w", "type": "duckdb"}]}}
    )
    writer = DestinationWriter(config, config.pipeline.destinations[0])
    first = [{"id": 1, "at": "2024-05-01T12:00:00Z", "v": 1}, {"id": 2, "at": None, "v": "x"}]
    second = [{"id": 3, "at": "not a time", "v": 2.5}, {"id": 4, "at": "2024-05-02T00:00:00Z"}]
    third = [{"id": 5, "at": "2024-05-03T00:00:00Z", "v": True, "new": "2024-05-03T00:00:00Z"}]
    try:
        cold = jobs_of(spark, "hw-b0", lambda: writer(batch(spark, first, key=None), 0))
        warm = jobs_of(spark, "hw-b1", lambda: writer(batch(spark, second, key=None), 1))
        grown = jobs_of(spark, "hw-b2", lambda: writer(batch(spark, third, key=None), 2))
        # (an aggregation may run as more than one job under adaptive execution)
        assert warm < cold  # no inference pass of its own
        assert grown == cold  # a new text field ("new") is probed separately again
        types = {c.name: c.type.value for c in writer.destination.table("events").columns.values()}
        assert types["at"] == "TIMESTAMP" and types["at__string"] == "STRING"
        assert types["v"] == "STRING" and types["new"] == "TIMESTAMP"
        rows = read_rows(writer, "select id, at__string, v from events order by id")
        assert [tuple(r) for r in rows] == [
            (1, None, "1"),
            (2, None, "x"),
            (3, "not a time", "2.5"),
            (4, None, None),
            (5, None, "true"),
        ]
    finally:
        writer.close()
