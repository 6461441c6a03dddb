"""Schema evolution through the whole writer (steps, typing, table patching, the write), against
DuckDB, PostgreSQL, ClickHouse (chdb) and Delta Lake: new fields, type drift across batches
(int -> float -> string, bool -> int, timestamp -> string), nested objects appearing, and a
column added underneath by another writer. No value is ever lost: what does not fit a column
lands in its typed sibling ``<name>__<type>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from headwater.config.model import HeadwaterConfig
from headwater.destinations.types import ColumnType as T
from headwater.pipeline.writer import DestinationWriter
from headwater.testing.pipeline import batch
from headwater.testing.warehouse import add_column_elsewhere, read_rows, scratch_destination


@pytest.fixture(params=["duckdb", "postgres", "clickhouse", "delta"])
def writer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DestinationWriter]:
    dest = scratch_destination(request, str(request.param), tmp_path)
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": [dest]}}
    )
    w = DestinationWriter(config, config.pipeline.destinations[0])
    yield w
    w.close()


SEQUENCE: list[list[dict[str, Any]]] = [
    [{"id": 1, "n": 1, "flag": True, "at": "2024-05-01T12:00:00Z", "name": "a"}],
    [{"id": 2, "n": 2.5, "flag": 3, "at": "not a time", "extra": {"deep": {"x": 1}}}],
    [{"id": 3, "n": "many", "flag": False, "extra": {"deep": {"x": 2, "y": [1, 2]}}}],
]


def types_of(writer: DestinationWriter) -> dict[str, T]:
    schema = writer.destination.table("events")
    assert schema is not None
    return {c.name: c.type for c in schema.columns.values()}


def test_type_drift_new_fields_and_nested_objects(spark: Any, writer: DestinationWriter) -> None:
    for batch_id, values in enumerate(SEQUENCE):
        writer(batch(spark, values, key=None), batch_id)
        assert writer.last is not None and writer.last.failed == 0

    types = types_of(writer)
    assert {
        "id": T.INT64,
        "n": T.INT64,
        "n__float64": T.FLOAT64,
        "n__string": T.STRING,
        "flag": T.BOOL,
        "flag__int64": T.INT64,
        "at": T.TIMESTAMP,
        "at__string": T.STRING,
        "name": T.STRING,
        "extra_deep_x": T.INT64,
        "extra_deep_y": T.STRING,
    }.items() <= types.items()
    rows = read_rows(
        writer,
        'select id, n, n__float64, n__string, flag, flag__int64, "at", at__string, extra_deep_x, '
        "extra_deep_y from events order by id",
    )
    assert [normal(r) for r in rows] == [
        (1, 1, None, None, True, None, datetime(2024, 5, 1, 12, tzinfo=UTC), None, None, None),
        (2, None, 2.5, None, None, 3, None, "not a time", 1, None),
        (3, None, None, "many", False, None, None, None, 2, "[1,2]"),
    ]


def test_column_added_underneath_by_another_writer(spark: Any, writer: DestinationWriter) -> None:
    writer(batch(spark, [{"id": 1, "name": "a"}]), 0)
    add_column_elsewhere(writer, "events", "other", writer.destination.dialect.sql_type(T.STRING))
    # this writer still believes the table has two columns; the write must find "other"
    writer(batch(spark, [{"id": 2, "name": "b", "other": "x", "fresh": 1.5}]), 1)
    assert writer.last is not None and writer.last.written == 1
    assert types_of(writer)["other"] == T.STRING
    rows = read_rows(writer, "select id, name, other, fresh from events order by id")
    assert [normal(r) for r in rows] == [(1, "a", None, None), (2, "b", "x", 1.5)]


def test_a_replayed_batch_writes_nothing(spark: Any, writer: DestinationWriter) -> None:
    frame = batch(spark, [{"id": 1}, {"id": 2}])
    writer(frame, 0)
    writer(frame, 0)
    assert writer.last is not None and writer.last.replayed_batch
    assert read_rows(writer, "select count(*) from events") == [(2,)]


def normal(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """Warehouse values in Python's terms: Decimal -> float, 0/1 flags -> bool, UTC datetimes."""
    out = []
    for v in row:
        if hasattr(v, "as_integer_ratio") and not isinstance(v, int | float):
            v = float(v)
        if isinstance(v, datetime):
            v = v.astimezone(UTC) if v.tzinfo else v.replace(tzinfo=UTC)
        out.append(v)
    return tuple(out)
