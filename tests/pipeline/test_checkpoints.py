"""A destination's checkpoint after a kill: Spark writes each offsets file to a temporary beside
it and renames it; a kill before the first rename leaves only the temporary, and Spark refuses
a checkpoint with files but no batch as a new query's. The pipeline starts such a checkpoint
as new (nothing was planned from it) and lands every event."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.pipeline.test_end_to_end import make_config, send_segment, wait_for

from headwater.bus import open_bus
from headwater.pipeline.runner import Pipeline
from headwater.testing.collector import RunningCollector, running_collector

TEMPORARY = ".0.3f1c2a9e-5b7d-4c1e-9a0f-2d6b8e4c7a11.tmp"


def half_written_first_batch(checkpoint: Path) -> list[Path]:
    """What a kill mid-write of batch 0's offsets leaves: the temporary and its checksum."""
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True)
    left = [offsets / TEMPORARY, offsets / f".{TEMPORARY}.crc"]
    left[0].write_text('v1\n{"batchWatermarkMs":0,"batchTimestampMs":17')
    left[1].write_bytes(b"crc\x00")
    return left


@contextmanager
def batch_pipeline(spark: Any, tmp_path: Path) -> Iterator[tuple[Pipeline, RunningCollector]]:
    """A DuckDB destination in batch mode, and a collector in front of its bus."""
    config = make_config(tmp_path, {"id": "wh", "type": "duckdb", "mode": "batch"})
    bus = open_bus(config)
    pipeline = Pipeline(config, spark)
    try:
        with running_collector(bus, config.collector) as server:
            yield pipeline, server
    finally:
        pipeline.stop()
        bus.close()


def test_a_checkpoint_killed_while_its_first_batch_was_planned_starts_as_new(
    spark: Any, tmp_path: Path
) -> None:
    checkpoint = make_config(tmp_path, {"id": "wh", "type": "duckdb"}).checkpoint_dir() / "wh"
    left = half_written_first_batch(checkpoint)
    with batch_pipeline(spark, tmp_path) as (pipeline, server):
        send_segment(server, 5)
        pipeline.run_once()
        writer = pipeline.queries[0].writer
        wait_for(lambda: writer.written >= 5, "5 rows written")
        assert writer.failed_events == 0
    assert not any(p.exists() for p in left)
    assert (checkpoint / "offsets" / "0").is_file()


def test_a_checkpoint_with_a_batch_keeps_its_files(spark: Any, tmp_path: Path) -> None:
    """A temporary beside a planned batch is Spark's to deal with: nothing is removed."""
    offsets = make_config(tmp_path, {"id": "wh", "type": "duckdb"}).checkpoint_dir() / "wh"
    stray = offsets / "offsets" / ".1.0d9e8f7a-6b5c-4d3e-2f1a-0b9c8d7e6f5a.tmp"
    with batch_pipeline(spark, tmp_path) as (pipeline, server):
        send_segment(server, 3)
        pipeline.run_once()
        stray.write_text("v1\n")
        pipeline.run_once()
        assert pipeline.queries[0].writer.written == 3
    assert stray.exists()
