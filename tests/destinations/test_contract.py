"""The destination contract, against the real thing: DuckDB, PostgreSQL, ClickHouse (chdb) and
files. Create and patch tables, write and read back values and types, replays write nothing,
upserts, columns added or dropped underneath, UTC timestamps, nulls."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from headwater.destinations import Column, Destination, TableSchema, open_destination
from headwater.destinations.base import DestinationError
from headwater.destinations.types import ColumnType as T
from headwater.pipeline.config import DestinationConfig
from headwater.testing.warehouse import execute_elsewhere, query, scratch_destination

SQL_KINDS = ["duckdb", "postgres", "clickhouse"]
AT = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=UTC)


def open_kind(request: pytest.FixtureRequest, kind: str, tmp_path: Path, **kw: Any) -> Destination:
    config = DestinationConfig.model_validate(scratch_destination(request, kind, tmp_path, **kw))
    return open_destination(config, tmp_path / "data")


@pytest.fixture(params=SQL_KINDS)
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Destination]:
    d = open_kind(request, str(request.param), tmp_path)
    yield d
    d.close()


def schema(pk: tuple[str, ...] = (), **cols: T) -> TableSchema:
    return TableSchema("events", {n: Column(n, t) for n, t in cols.items()}, pk)


def rows(**cols: list[Any]) -> pa.Table:
    types = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
    arrays = {}
    for name, values in cols.items():
        kind = next((type(v) for v in values if v is not None), str)
        t = pa.timestamp("us", tz="UTC") if kind is datetime else types[kind]
        arrays[name] = pa.array(values, t)
    return pa.table(arrays)


def sel(d: Destination, sql: str, final: bool = False) -> list[tuple[Any, ...]]:
    final_ = " FINAL" if d.kind == "clickhouse" and final else ""
    sql = sql.replace("FROM events", "FROM events" + final_)
    return [tuple(_py(v) for v in r) for r in query(d, sql)]


def _py(v: Any) -> Any:
    if hasattr(v, "as_integer_ratio") and not isinstance(v, int | float):
        return float(v)  # Decimal
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def test_create_patch_write_and_read_back(dest: Destination) -> None:
    assert dest.table("events") is None
    created = dest.ensure_table(schema(id=T.INT64, name=T.STRING))
    assert {n: c.type for n, c in created.columns.items()} == {"id": T.INT64, "name": T.STRING}
    patched = dest.ensure_table(
        schema(id=T.INT64, ok=T.BOOL, price=T.FLOAT64, seen_at=T.TIMESTAMP, name=T.STRING)
    )
    assert {n: c.type for n, c in patched.columns.items()} == {
        "id": T.INT64,
        "name": T.STRING,
        "ok": T.BOOL,
        "price": T.FLOAT64,
        "seen_at": T.TIMESTAMP,
    }
    assert dest.table("events") == patched
    batch = rows(
        id=[1, 2, 3],
        name=["a", None, "ünï ☃"],
        ok=[True, False, None],
        price=[1.5, None, 2.0**53],
        seen_at=[AT, None, datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC)],
    )
    assert dest.write_batch("w1", 0, {"events": batch}) is True
    assert sel(dest, "SELECT id, name, ok, price, seen_at FROM events ORDER BY id") == [
        (1, "a", True, 1.5, AT),
        (2, None, False, None, None),
        (3, "ünï ☃", None, 2.0**53, datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ]
    assert dest.committed("w1") == 0 and dest.committed("other") is None


def test_a_replayed_batch_writes_nothing(dest: Destination) -> None:
    dest.ensure_table(schema(id=T.INT64))
    batch = {"events": rows(id=[1, 2])}
    assert dest.write_batch("w", 7, batch) is True
    assert dest.write_batch("w", 7, batch) is False
    assert dest.write_batch("other-writer", 7, batch) is True  # ledgers are per writer
    assert sel(dest, "SELECT count(*) FROM events") == [(4,)]
    assert dest.committed("w") == 7


def test_an_empty_batch_is_recorded(dest: Destination) -> None:
    assert dest.write_batch("w", 0, {}) is True
    assert dest.write_batch("w", 0, {}) is False
    assert dest.committed("w") == 0


def test_upsert_on_primary_key_last_row_wins(dest: Destination) -> None:
    dest.ensure_table(schema(pk=("id",), id=T.INT64, v=T.STRING))
    assert dest.table("events").primary_key == ("id",)  # type: ignore[union-attr]
    dest.write_batch("w", 0, {"events": rows(id=[1, 2, 1], v=["a", "b", "c"])})
    dest.write_batch("w", 1, {"events": rows(id=[2, 3], v=["B", "C"])})
    assert sel(dest, "SELECT id, v FROM events ORDER BY id", final=True) == [
        (1, "c"),
        (2, "B"),
        (3, "C"),
    ]


def test_column_added_underneath_is_found_and_kept(dest: Destination) -> None:
    dest.ensure_table(schema(id=T.INT64))
    q = dest.dialect.quote
    ref = q("events")
    ext = "Nullable(String)" if dest.kind == "clickhouse" else "TEXT"
    execute_elsewhere(dest, f"ALTER TABLE {ref} ADD COLUMN {q('note')} {ext}")
    after = dest.ensure_table(schema(id=T.INT64, note=T.STRING, n=T.INT64))
    assert set(after.columns) == {"id", "note", "n"}
    dest.write_batch("w", 0, {"events": rows(id=[1], note=["x"], n=[5])})
    assert sel(dest, "SELECT id, note, n FROM events") == [(1, "x", 5)]


def test_column_dropped_underneath_is_restored_and_the_write_retried(dest: Destination) -> None:
    dest.ensure_table(schema(id=T.INT64, gone=T.STRING))
    ref = "events"
    execute_elsewhere(dest, f"ALTER TABLE {ref} DROP COLUMN gone")
    assert dest.write_batch("w", 0, {"events": rows(id=[1], gone=["back"])}) is True
    assert sel(dest, "SELECT id, gone FROM events") == [(1, "back")]


def test_timestamps_are_stored_in_utc(dest: Destination) -> None:
    dest.ensure_table(schema(seen_at=T.TIMESTAMP))
    naive_utc = pa.table({"seen_at": pa.array([datetime(2024, 1, 1, 23, 30)], pa.timestamp("us"))})
    dest.write_batch("w", 0, {"events": naive_utc})
    assert sel(dest, "SELECT seen_at FROM events") == [(datetime(2024, 1, 1, 23, 30, tzinfo=UTC),)]


# -- files ------------------------------------------------------------------------------------


def test_parquet_files_per_table_and_batch(request, tmp_path: Path) -> None:
    d = open_kind(request, "files", tmp_path)
    d.ensure_table(schema(id=T.INT64, seen_at=T.TIMESTAMP))
    batch = {"events": rows(id=[1, 2], seen_at=[AT, None])}
    assert d.write_batch("w", 3, batch) is True
    assert d.write_batch("w", 3, batch) is False
    files = sorted((tmp_path / "files" / "events").glob("*.parquet"))
    assert [f.name for f in files] == ["w-000000000003.parquet"]
    assert pq.read_table(files[0]).to_pylist() == [
        {"id": 1, "seen_at": AT},
        {"id": 2, "seen_at": None},
    ]
    assert d.table("events").columns["seen_at"].type == T.TIMESTAMP  # type: ignore[union-attr]


def test_jsonl_gz_archive_per_day(request, tmp_path: Path) -> None:
    d = open_kind(request, "files", tmp_path, format="jsonl.gz")
    other_day = datetime(2024, 5, 2, 0, 0, 1, tzinfo=UTC)
    d.write_batch("w", 0, {"events": rows(id=[1, 2], _timestamp=[AT, other_day])})
    root = tmp_path / "files" / "events"
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gz")) == [
        "2024-05-01/w-000000000000.jsonl.gz",
        "2024-05-02/w-000000000000.jsonl.gz",
    ]
    lines = gzip.decompress((root / "2024-05-02/w-000000000000.jsonl.gz").read_bytes())
    assert [json.loads(x) for x in lines.splitlines()] == [
        {"id": 2, "_timestamp": "2024-05-02T00:00:01+00:00"}
    ]


def test_files_refuse_a_primary_key(request, tmp_path: Path) -> None:
    with pytest.raises(DestinationError, match="only append"):
        open_kind(request, "files", tmp_path, primary_key=["id"])


def test_chdb_refuses_a_second_data_folder(request, tmp_path: Path) -> None:
    request.getfixturevalue("chdb_path")
    open_kind(request, "clickhouse", tmp_path).close()
    config = DestinationConfig(id="x", type="clickhouse", path=tmp_path / "elsewhere")
    with pytest.raises(DestinationError, match="one embedded ClickHouse per process"):
        open_destination(config, tmp_path)
