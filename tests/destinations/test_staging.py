"""Executors stage, the driver commits (``Destination.stage`` / ``commit_staged``), against the
real thing: parts staged by two "tasks" committed with the ledger in one step, a batch the
ledger holds writes nothing, upserts keep the highest ``_hw_order``, a discarded part (a failed
attempt) is never visible, ``clean_staging`` removes what a crashed run left, and a crash between
staging and commit gives every row once after the restart."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from headwater.destinations import Column, Destination, TableSchema, open_destination
from headwater.destinations.base import ORDER_COLUMN, DestinationUnavailable, StagedPart
from headwater.destinations.types import ColumnType as T
from headwater.pipeline.config import DestinationConfig
from headwater.testing.warehouse import delta_leftovers, query, scratch_destination

KINDS = ["duckdb", "postgres", "files", "clickhouse", "delta"]
SQL_KINDS = ["duckdb", "postgres", "clickhouse"]
AT = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=UTC)


def config_for(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> DestinationConfig:
    return DestinationConfig.model_validate(scratch_destination(request, kind, tmp_path))


@pytest.fixture(params=KINDS)
def made(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Destination, Any]]:
    """A destination and a function that opens another instance on the same place."""
    config = config_for(request, str(request.param), tmp_path)

    def reopen() -> Destination:
        return open_destination(config, tmp_path / "data")

    d = reopen()
    yield d, reopen
    d.close()


@pytest.fixture
def dest(made: tuple[Destination, Any]) -> Destination:
    return made[0]


def schema(name: str = "events", pk: tuple[str, ...] = (), **cols: T) -> TableSchema:
    return TableSchema(name, {n: Column(n, t) for n, t in cols.items()}, pk)


def batch(ids: list[int], vs: list[str | None], order: list[int] | None = None) -> pa.Table:
    order = order if order is not None else list(range(len(ids)))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "v": pa.array(vs, pa.string()),
            ORDER_COLUMN: pa.array(order, pa.int64()),
        }
    )


def sel(
    d: Destination, sql: str, table: str = "events", final: bool = False
) -> list[tuple[Any, ...]]:
    if d.kind == "files":
        root = d.root  # type: ignore[attr-defined]
        sql = sql.replace(f"FROM {table}", f"FROM read_parquet('{root}/{table}/*.parquet')")
        with closing(duckdb.connect()) as c:
            c.execute("SET TimeZone = 'UTC'")
            return c.execute(sql).fetchall()
    if d.kind == "clickhouse" and final:  # a ReplacingMergeTree: read after replacing
        sql = sql.replace(f"FROM {table}", f"FROM {table} FINAL")
    return [tuple(_py(v) for v in r) for r in query(d, sql)]


def _py(v: Any) -> Any:
    if hasattr(v, "as_integer_ratio") and not isinstance(v, int | float):
        return float(v)  # Decimal
    if isinstance(v, datetime):
        return v.astimezone(UTC)
    return v


def leftovers(d: Destination) -> list[str]:
    """Whatever staging ``d`` holds now (files, or staging tables)."""
    if d.kind == "postgres":
        import psycopg

        from headwater.destinations.postgres.client import STAGING_SCHEMA

        with psycopg.connect(d.dsn) as c:  # type: ignore[attr-defined]
            rows = c.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (STAGING_SCHEMA,)
            ).fetchall()
        return sorted(str(r[0]) for r in rows)
    if d.kind == "delta":
        return delta_leftovers(d)
    folder: Path = d.staging  # type: ignore[attr-defined]
    return sorted(str(p) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_two_tasks_stage_and_the_driver_commits_rows_with_the_ledger(dest: Destination) -> None:
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    if dest.kind != "files":
        schemas["other"] = dest.ensure_table(schema("other", id=T.INT64, v=T.STRING))
    first = dest.stage("w", 3, "p0a0", {"events": batch([1, 2], ["a", "b"])})
    second_tables = {"events": batch([3], ["c"], [2])}
    if "other" in schemas:
        second_tables["other"] = batch([9], ["z"])
    second = dest.stage("w", 3, "p1a0", second_tables)
    assert all(isinstance(p, StagedPart) and p.rows for p in first + second)
    assert len({p.ref for p in first + second}) == len(first + second)
    parts = [StagedPart.from_json(p.to_json()) for p in first + second]  # as a message carries
    assert sel(dest, "SELECT count(*) FROM events") == [(0,)] if dest.kind != "files" else True
    assert dest.committed("w") is None
    assert dest.commit_staged("w", 3, parts, schemas) is True
    assert sel(dest, "SELECT id, v FROM events ORDER BY id") == [(1, "a"), (2, "b"), (3, "c")]
    if "other" in schemas:
        assert sel(dest, "SELECT id, v FROM other", "other") == [(9, "z")]
    assert dest.committed("w") == 3
    assert leftovers(dest) == []
    table = dest.table("events")
    assert table is not None and ORDER_COLUMN not in table.columns


def test_values_and_types_survive_staging(dest: Destination) -> None:
    cols = {"id": T.INT64, "s": T.STRING, "ok": T.BOOL, "x": T.FLOAT64, "seen_at": T.TIMESTAMP}
    schemas = {"events": dest.ensure_table(schema(**cols))}
    text = ["", "line\nbreak", 'a "quoted", comma', "back\\slash \\N", "NULL", "ünï ☃", None]
    n = len(text)
    rows = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "s": pa.array(text, pa.string()),
            "ok": pa.array([True, False, None, True, False, None, True]),
            "x": pa.array([1.5, 0.1 + 0.2, None, 2.0**53, -1e-300, 3.0, 0.0]),
            "seen_at": pa.array([AT, None] * 3 + [AT], pa.timestamp("us")),  # naive UTC, as Spark
            ORDER_COLUMN: pa.array(range(n), pa.int64()),
        }
    )
    parts = dest.stage("w", 0, "p0a0", {"events": rows})
    assert dest.commit_staged("w", 0, parts, schemas) is True
    got = sel(dest, "SELECT id, s, ok, x, seen_at FROM events ORDER BY id")
    want = [tuple(r.values()) for r in rows.drop_columns([ORDER_COLUMN]).to_pylist()]
    want = [(*r[:4], r[4].replace(tzinfo=UTC) if r[4] else None) for r in want]
    assert [(*r[:4], _py(r[4]) if r[4] else None) for r in got] == want


def test_a_batch_the_ledger_holds_writes_nothing(dest: Destination) -> None:
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    parts = dest.stage("w", 0, "p0a0", {"events": batch([1], ["a"])})
    assert dest.commit_staged("w", 0, parts, schemas) is True
    again = dest.stage("w", 0, "p0a1", {"events": batch([1, 2], ["a", "b"])})
    assert dest.commit_staged("w", 0, again, schemas) is False
    assert sel(dest, "SELECT id, v FROM events") == [(1, "a")]
    assert leftovers(dest) == []  # the refused parts' staging is gone too
    # another writer's batch 0 is its own
    other = dest.stage("w2", 0, "p0a0", {"events": batch([5], ["e"])})
    assert dest.commit_staged("w2", 0, other, schemas) is True
    assert sel(dest, "SELECT count(*) FROM events") == [(2,)]


def test_an_empty_batch_is_recorded(dest: Destination) -> None:
    assert dest.commit_staged("w", 4, [], {}) is True
    assert dest.commit_staged("w", 4, [], {}) is False
    assert dest.committed("w") == 4


@pytest.mark.parametrize("made", SQL_KINDS, indirect=True)
def test_upsert_keeps_the_row_with_the_highest_order(dest: Destination) -> None:
    schemas = {"events": dest.ensure_table(schema(pk=("id",), id=T.INT64, v=T.STRING))}
    dest.write_batch(
        "w", 0, {"events": batch([1, 2], ["old1", "old2"]).drop_columns([ORDER_COLUMN])}
    )
    # task 0 holds the batch's last row for key 1 (order 7), task 1 an earlier one (order 3)
    a = dest.stage("w", 1, "p0a0", {"events": batch([1, 3], ["last", "x"], [7, 1])})
    b = dest.stage("w", 1, "p1a0", {"events": batch([1, 3, 3], ["early", "y", "z"], [3, 5, 2])})
    assert dest.commit_staged("w", 1, a + b, schemas) is True
    assert sel(dest, "SELECT id, v FROM events ORDER BY id", final=True) == [
        (1, "last"),
        (2, "old2"),
        (3, "y"),
    ]


def test_a_discarded_attempt_is_never_visible(dest: Destination) -> None:
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    failed = dest.stage("w", 0, "p0a0", {"events": batch([1, 2], ["a", "b"])})
    retried = dest.stage("w", 0, "p0a1", {"events": batch([1, 2], ["a", "b"])})
    assert {p.ref for p in failed}.isdisjoint(p.ref for p in retried)
    dest.discard_staged("w", 0, failed)
    assert dest.commit_staged("w", 0, retried, schemas) is True
    assert sel(dest, "SELECT id, v FROM events ORDER BY id") == [(1, "a"), (2, "b")]
    assert leftovers(dest) == []


def test_clean_staging_removes_a_writers_leftovers_only(made: tuple[Destination, Any]) -> None:
    dest, reopen = made
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    mine = dest.stage("w", 0, "p0a0", {"events": batch([1], ["a"])})
    theirs = dest.stage("w2", 0, "p0a0", {"events": batch([2], ["b"])})
    later = reopen()  # the writer restarting
    later.clean_staging("w")
    assert len(leftovers(dest)) == len(theirs)
    with pytest.raises(DestinationUnavailable):  # the parts are gone: stage again
        later.commit_staged("w", 0, mine, schemas)
    assert later.committed("w") is None
    assert later.commit_staged("w2", 0, theirs, schemas) is True
    assert sel(later, "SELECT id FROM events") == [(2,)]
    later.close()


def test_a_crash_between_stage_and_commit_gives_every_row_once(
    made: tuple[Destination, Any],
) -> None:
    dest, reopen = made
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    dest.stage("w", 0, "p0a0", {"events": batch([1, 2], ["a", "b"])})
    dest.stage("w", 0, "p1a0", {"events": batch([3], ["c"])})
    dest.close()  # the run dies here: its parts were staged, never committed
    restarted = reopen()
    restarted.clean_staging("w")
    assert leftovers(restarted) == []
    parts = restarted.stage("w", 0, "p0a0", {"events": batch([1, 2], ["a", "b"])})
    parts += restarted.stage("w", 0, "p1a0", {"events": batch([3], ["c"])})
    assert restarted.commit_staged("w", 0, parts, schemas) is True
    assert sel(restarted, "SELECT id, v FROM events ORDER BY id") == [(1, "a"), (2, "b"), (3, "c")]
    restarted.close()


def test_a_files_commit_cut_short_is_rolled_forward(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files commit by renames under an intent file: a crash after the intent and the first
    rename leaves the batch to be finished by the next start, not half there or written twice."""
    import os

    config = config_for(request, "files", tmp_path)
    dest = open_destination(config, tmp_path / "data")
    schemas = {"events": dest.ensure_table(schema(id=T.INT64, v=T.STRING))}
    parts = dest.stage("w", 0, "p0a0", {"events": batch([1, 2], ["a", "b"])})
    parts += dest.stage("w", 0, "p1a0", {"events": batch([3], ["c"])})
    real = os.replace
    calls = []

    def crashing(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 3:  # the intent, the first part: then the power goes
            raise SystemExit("crash")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crashing)
    with pytest.raises(SystemExit):
        dest.commit_staged("w", 0, parts, schemas)
    monkeypatch.setattr(os, "replace", real)
    assert dest.committed("w") is None
    restarted = open_destination(config, tmp_path / "data")
    restarted.clean_staging("w")  # the writer starting again
    assert restarted.committed("w") == 0
    assert sel(restarted, "SELECT id, v FROM events ORDER BY id") == [(1, "a"), (2, "b"), (3, "c")]
    assert leftovers(restarted) == []
    # the replayed batch (Spark did not see it committed) writes nothing
    again = restarted.stage("w", 0, "p0a0", {"events": batch([1, 2, 3], ["a", "b", "c"])})
    assert restarted.commit_staged("w", 0, again, schemas) is False
    assert sel(restarted, "SELECT count(*) FROM events") == [(3,)]
