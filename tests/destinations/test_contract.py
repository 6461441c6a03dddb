"""The destination contract, against the real thing: DuckDB, PostgreSQL, ClickHouse (chdb) and
files. Create and patch tables, write and read back values and types, replays write nothing,
upserts (also after a restart), columns added or dropped underneath, concurrent patching, a
batch failing midway then replayed, UTC timestamps, nulls and awkward text, and how each
connector classifies its errors."""

from __future__ import annotations

import errno
import gzip
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from headwater.destinations import Column, Destination, TableSchema, open_destination
from headwater.destinations.base import DestinationError, DestinationUnavailable
from headwater.destinations.files.client import classify as classify_files
from headwater.destinations.sql import LEDGER
from headwater.destinations.types import ColumnType as T
from headwater.pipeline.config import DestinationConfig
from headwater.testing.warehouse import execute_elsewhere, query, scratch_destination

SQL_KINDS = ["duckdb", "postgres", "clickhouse"]
ALL_KINDS = [*SQL_KINDS, "files", "delta"]
AT = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=UTC)


def open_kind(request: pytest.FixtureRequest, kind: str, tmp_path: Path, **kw: Any) -> Destination:
    config = DestinationConfig.model_validate(scratch_destination(request, kind, tmp_path, **kw))
    return open_destination(config, tmp_path / "data")


@pytest.fixture(params=SQL_KINDS)
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Destination]:
    d = open_kind(request, str(request.param), tmp_path)
    yield d
    d.close()


@pytest.fixture(params=ALL_KINDS)
def any_dest(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Destination]:
    """Every destination, files included (for what files can do: append, replay, types)."""
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
    """Rows of ``sql`` over what ``d`` wrote, read through a connection of their own (files:
    DuckDB over the Parquet files)."""
    if d.kind == "files":
        root = d.root  # type: ignore[attr-defined]
        sql = sql.replace("FROM events", f"FROM read_parquet('{root}/events/*.parquet')")
        with closing(duckdb.connect()) as c:
            c.execute("SET TimeZone = 'UTC'")
            return [tuple(_py(v) for v in r) for r in c.execute(sql).fetchall()]
    final_ = " FINAL" if d.kind == "clickhouse" and final else ""
    sql = sql.replace("FROM events", "FROM events" + final_)
    return [tuple(_py(v) for v in r) for r in query(d, sql)]


def _py(v: Any) -> Any:
    if hasattr(v, "as_integer_ratio") and not isinstance(v, int | float):
        return float(v)  # Decimal
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def test_create_patch_write_and_read_back(any_dest: Destination) -> None:
    dest = any_dest
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


def test_a_replayed_batch_writes_nothing(any_dest: Destination) -> None:
    dest = any_dest
    dest.ensure_table(schema(id=T.INT64))
    batch = {"events": rows(id=[1, 2])}
    assert dest.write_batch("w", 7, batch) is True
    assert dest.write_batch("w", 7, batch) is False
    assert dest.write_batch("other-writer", 7, batch) is True  # ledgers are per writer
    assert sel(dest, "SELECT count(*) FROM events") == [(4,)]
    assert dest.committed("w") == 7


def test_an_empty_batch_is_recorded(any_dest: Destination) -> None:
    dest = any_dest
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


TRICKY_TEXT = ["", "line\nbreak", 'a "quoted", comma', "back\\slash \\N", "NULL", "ünï ☃ 🐟"]


def test_text_comes_back_as_written_and_empty_is_not_null(any_dest: Destination) -> None:
    dest = any_dest
    dest.ensure_table(schema(id=T.INT64, s=T.STRING))
    values = [*TRICKY_TEXT, None]
    dest.write_batch("w", 0, {"events": rows(id=list(range(len(values))), s=values)})
    assert sel(dest, "SELECT s FROM events ORDER BY id") == [(v,) for v in values]


def test_timestamps_are_stored_in_utc(any_dest: Destination) -> None:
    dest = any_dest
    dest.ensure_table(schema(seen_at=T.TIMESTAMP))
    naive_utc = pa.table({"seen_at": pa.array([datetime(2024, 1, 1, 23, 30)], pa.timestamp("us"))})
    dest.write_batch("w", 0, {"events": naive_utc})
    assert sel(dest, "SELECT seen_at FROM events") == [(datetime(2024, 1, 1, 23, 30, tzinfo=UTC),)]


def same_place(d: Any) -> dict[str, Any]:
    """Config fields that open another destination object on what ``d`` writes to."""
    if d.kind == "duckdb":
        return {"type": "duckdb", "path": d.path}
    if d.kind == "postgres":
        return {"type": "postgres", "dsn": d.dsn}
    return {"type": "clickhouse", "path": d.path, "options": {"database": d.database}}


def test_a_reopened_destination_still_upserts(
    request: pytest.FixtureRequest, tmp_path: Path, dest: Destination
) -> None:
    """After a restart the primary key comes from the catalog, not from this process's patching."""
    dest.ensure_table(schema(pk=("id",), id=T.INT64, v=T.STRING))
    dest.write_batch("w", 0, {"events": rows(id=[1, 2], v=["a", "b"])})
    dest.close()
    again = open_destination(DestinationConfig(id="wh", **same_place(dest)), tmp_path / "data")
    try:
        assert again.write_batch("w", 1, {"events": rows(id=[2, 2], v=["x", "y"])}) is True
        assert sel(again, "SELECT id, v FROM events ORDER BY id", final=True) == [
            (1, "a"),
            (2, "y"),
        ]
    finally:
        again.close()


def _count(d: Destination, table: str) -> int:
    return int(query(d, f"SELECT count(*) FROM {table}")[0][0])


def test_a_batch_that_fails_midway_and_is_replayed_lands_once(dest: Destination) -> None:
    """The first table's rows and the ledger row commit with the rest or not at all (ClickHouse:
    the first table's insert is repeated on replay, and its deduplication token drops it)."""
    dest.ensure_table(TableSchema("a", {"id": Column("id", T.INT64)}))
    dest.ensure_table(TableSchema("b", {"n": Column("n", T.INT64)}))
    good_a = rows(id=[1, 2])
    with pytest.raises(DestinationError) as failed:
        dest.write_batch("w", 5, {"a": good_a, "b": rows(n=["not a number"])})
    assert failed.value.code == "HW-DST-001"  # a bad value is terminal
    assert dest.committed("w") is None
    if dest.kind != "clickhouse":  # one transaction: nothing of the batch is there
        assert _count(dest, "a") == 0
    assert dest.write_batch("w", 5, {"a": good_a, "b": rows(n=[7])}) is True
    assert (_count(dest, "a"), _count(dest, "b"), dest.committed("w")) == (2, 1, 5)


def test_patching_from_several_writers_at_once_keeps_every_column(
    request: pytest.FixtureRequest, tmp_path: Path, dest: Destination
) -> None:
    """Writers (each its own destination object and connection) add different columns to the
    same table at the same moment: the table ends with all of them, and nobody fails."""
    dest.ensure_table(schema(id=T.INT64))
    kwargs: dict[str, Any] = {"type": dest.kind}
    if dest.kind == "duckdb":
        kwargs["path"] = dest.path  # type: ignore[attr-defined]
    elif dest.kind == "postgres":
        kwargs["dsn"] = dest.dsn  # type: ignore[attr-defined]
    else:
        kwargs.update(path=dest.path, options={"database": dest.database})  # type: ignore[attr-defined]
    writers = [
        open_destination(DestinationConfig(id=f"w{i}", **kwargs), tmp_path) for i in range(4)
    ]
    start = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def patch(i: int, d: Destination) -> None:
        try:
            start.wait(timeout=30)
            # everyone adds "shared"; each adds a column of its own
            d.ensure_table(schema(id=T.INT64, shared=T.STRING, **{f"c{i}": T.INT64}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=patch, args=(i, d)) for i, d in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for d in writers:
        d.close()
    assert not errors
    assert set(dest.table("events").columns) == {"id", "shared", "c0", "c1", "c2", "c3"}  # type: ignore[union-attr]


def test_postgres_connection_lost_is_transient_and_the_next_call_reconnects(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    d = open_kind(request, "postgres", tmp_path)
    try:
        d.ensure_table(schema(id=T.INT64))
        pid = d._open.con.info.backend_pid  # type: ignore[attr-defined]
        with psycopg.connect(d.dsn, autocommit=True) as other:  # type: ignore[attr-defined]
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(DestinationUnavailable) as lost:
            d.write_batch("w", 0, {"events": rows(id=[1])})
        assert lost.value.transient and lost.value.code == "HW-DST-002"
        assert d.write_batch("w", 0, {"events": rows(id=[1])}) is True
        assert sel(d, "SELECT id FROM events") == [(1,)]
    finally:
        d.close()


def test_clickhouse_replay_after_a_crash_before_the_ledger_row_adds_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ClickHouse has no transactions: the rows go in first and the ledger row last. A crash in
    between replays the batch; its inserts carry the same deduplication tokens and add nothing,
    while another batch with the very same rows (another token) is kept."""
    d = open_kind(request, "clickhouse", tmp_path)
    d.ensure_table(schema(id=T.INT64, v=T.STRING))
    real = d.query  # type: ignore[attr-defined]
    crashes = []

    def crash_on_ledger(sql: str, hw_rows: pa.Table | None = None) -> list[tuple[Any, ...]]:
        if sql.startswith("INSERT") and LEDGER in sql and not crashes:
            crashes.append(sql)
            raise DestinationUnavailable("simulated crash before the ledger row")
        return real(sql, hw_rows)  # type: ignore[no-any-return]

    monkeypatch.setattr(d, "query", crash_on_ledger)
    batch = {"events": rows(id=[1, 2, 3], v=["a", "b", "c"])}
    with pytest.raises(DestinationUnavailable):
        d.write_batch("w", 0, batch)
    assert (_count(d, "events"), d.committed("w")) == (3, None)  # rows in, batch not recorded
    assert d.write_batch("w", 0, batch) is True  # the replay
    assert (_count(d, "events"), d.committed("w")) == (3, 0)
    assert d.write_batch("w", 1, batch) is True  # same rows, next batch: a new token
    assert _count(d, "events") == 6


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
    assert d.archives_events
    other_day = datetime(2024, 5, 2, 0, 0, 1, tzinfo=UTC)
    events = ['{"id":1,"user":{"name":"a"}}', '{"id":2,"tags":["x"]}']
    d.write_batch("w", 0, {"events": rows(event=events, _timestamp=[AT, other_day])})
    root = tmp_path / "files" / "events"
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gz")) == [
        "2024-05-01/w-000000000000.jsonl.gz",
        "2024-05-02/w-000000000000.jsonl.gz",
    ]
    lines = gzip.decompress((root / "2024-05-02/w-000000000000.jsonl.gz").read_bytes())
    assert lines == b'{"id":2,"tags":["x"]}\n'  # the event's own JSON, not flattened


def test_jsonl_gz_archive_names_missing_columns(request, tmp_path: Path) -> None:
    d = open_kind(request, "files", tmp_path, format="jsonl.gz")
    with pytest.raises(DestinationError, match="lack _timestamp"):
        d.write_batch("w", 0, {"events": rows(event=['{"id":1}'])})
    assert d.committed("w") is None


def test_files_refuse_a_primary_key(request, tmp_path: Path) -> None:
    with pytest.raises(DestinationError, match="only append"):
        open_kind(request, "files", tmp_path, primary_key=["id"])


def test_chdb_refuses_a_second_data_folder(request, tmp_path: Path) -> None:
    request.getfixturevalue("chdb_path")
    open_kind(request, "clickhouse", tmp_path).close()
    config = DestinationConfig(id="x", type="clickhouse", path=tmp_path / "elsewhere")
    with pytest.raises(DestinationError, match="one embedded ClickHouse per process"):
        open_destination(config, tmp_path)


# -- classification ---------------------------------------------------------------------------


def test_a_duckdb_file_held_by_another_process_is_transient(tmp_path: Path) -> None:
    path = tmp_path / "held.duckdb"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_DUCKDB, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        config = DestinationConfig(
            id="wh", type="duckdb", path=path, options={"lock_timeout_s": 0.2}
        )
        d = open_destination(config, tmp_path)
        with pytest.raises(DestinationUnavailable, match="locked by another process"):
            d.table("events")
    finally:
        holder.communicate(input="", timeout=30)  # closing stdin lets it go
    assert d.table("events") is None  # the file is free again


HOLD_DUCKDB = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
con.close()
"""


def test_files_classify_full_disks_as_transient_and_the_rest_as_terminal() -> None:
    full = classify_files(OSError(errno.ENOSPC, "No space left on device"))
    denied = classify_files(PermissionError(errno.EACCES, "Permission denied"))
    assert isinstance(full, DestinationUnavailable) and full.transient
    assert isinstance(denied, DestinationError) and not denied.transient
