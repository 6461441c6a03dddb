"""A task's rows stream through one query: many input batches, output in batches, and the
rows that need their input back (failed, novel) or a second query (malformed JSON) mid-stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from headwater.config.model import HeadwaterConfig
from headwater.destinations import open_destination
from headwater.pipeline.plan import plan
from headwater.pipeline.task import WRITE, TaskRun
from headwater.testing.pipeline import process, source_table

ID = "eventn_ctx_event_id"


def run_task(
    tmp_path: Path, values: list[Any], known_from: int, batch_rows: int
) -> tuple[list[str], dict[int, str], Any]:
    """Plan from what the first ``known_from`` values hold, then run every value through the
    task in input batches of 3 rows and output batches of ``batch_rows``: the ids of the rows
    staged (in order), the failed rows' codes by offset, and the summary."""
    known = process(source_table(values[:known_from]), path=tmp_path).knowledge
    config = HeadwaterConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "pipeline": {
                "destinations": [{"id": "wh", "type": "duckdb", "path": str(tmp_path / "wh.db")}]
            },
        }
    )
    dest_config = config.pipeline.destinations[0]
    destination = open_destination(dest_config, config.data_dir)
    try:
        program = plan(known, dest_config, destination, config.pipeline).program
    finally:
        destination.close()
    staged: list[str] = []
    failed: dict[int, str] = {}

    def on_rows(tables: dict[str, pa.Table]) -> None:
        for rows in tables.values():
            staged.extend(rows.column(ID).to_pylist())

    def on_failed(events: list[Any]) -> None:
        for e in events:
            assert e.offset not in failed, f"offset {e.offset} failed twice"
            failed[e.offset] = e.code

    run = TaskRun(program, "wh", WRITE, on_rows, on_failed, chunk_rows=batch_rows)
    summary = run.run(source_table(values).to_batches(max_chunksize=3))
    return staged, failed, summary


@pytest.mark.parametrize("batch_rows", [2, 5, 64])
def test_every_row_is_answered_once_across_batches(tmp_path, batch_rows):
    values: list[Any] = [{"n": i, "s": f"v{i}"} for i in range(40)]
    values[7] = "[1, 2]"  # not an object: the usual query fails it
    values[25] = '{"n": 25, "s": '  # malformed but looks like an object: the query stops there
    values[31] = {"n": 31, "s": "v31", "fresh": True}  # novel: a field the plan does not know
    staged, failed, summary = run_task(tmp_path, values, known_from=5, batch_rows=batch_rows)

    good = [f"ev-{i}" for i in range(40) if i not in (7, 25)]
    assert staged == good  # once each, in the log's order
    assert set(failed) == {7, 25}
    assert summary.rows == 40
    assert summary.failed == 2
    assert summary.novel >= 1  # row 31 (a field never seen), learned from the rows held back
    assert ("fresh",) in summary.leaves.get("events", {})


def test_reading_errors_are_reported_as_raised(tmp_path):
    values: list[Any] = [{"n": i} for i in range(10)]

    def batches() -> Any:
        yield from source_table(values).to_batches(max_chunksize=3)
        raise OSError("the log went away")

    known = process(source_table(values), path=tmp_path).knowledge
    config = HeadwaterConfig.model_validate(
        {"pipeline": {"destinations": [{"id": "wh", "type": "files", "path": str(tmp_path)}]}}
    )
    dest_config = config.pipeline.destinations[0]
    destination = open_destination(dest_config, tmp_path)
    program = plan(known, dest_config, destination, config.pipeline).program
    destination.close()
    with pytest.raises(OSError, match="the log went away"):
        TaskRun(program, "wh", WRITE, lambda t: None, lambda e: None, chunk_rows=2).run(batches())
