"""The apply statements of ``apply: upsert`` on real DuckDB and PostgreSQL, batch by batch: the
last change per key wins, a column left unchanged keeps its value, a truncate whose copies land
in different batches (a late partition) empties the table once and drops only what came before
it, and a table without a key appends."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import duckdb
import psycopg
import pyarrow as pa
import pytest

from headwater.testing.postgres import PostgresService
from headwater.transport.apply import (
    CHANGES,
    TRUNCATES_SQL,
    ApplySql,
    DuckDBApply,
    MirrorColumn,
    MirrorTable,
    PostgresApply,
)

NS = "db.public.t"
TABLE = MirrorTable(
    NS,
    "t",
    (MirrorColumn("id", "integer", True), MirrorColumn("v", "text"), MirrorColumn("big", "text")),
)
Change = tuple[str, int | None, dict[str, Any] | None, list[str] | None, int, int, int | None]


def batch(*changes: Change) -> pa.Table:
    """Changes as staged: (op, key id, data, unchanged, partition, offset, lsn)."""
    out: dict[str, list[Any]] = {name: [] for name in CHANGES.names}
    for op, key, data, unchanged, part, offset, lsn in changes:
        out["namespace"].append(NS)
        out["op"].append(op)
        out["key"].append(None if key is None else json.dumps({"id": key}))
        out["data"].append(None if data is None else json.dumps(data))
        out["unchanged"].append(json.dumps(unchanged) if unchanged else None)
        out["topic"].append("cdc.t")
        out["part"].append(part)
        out["_hw_order"].append(offset)
        out["lsn"].append(lsn)
    return pa.table(out, schema=CHANGES)


Apply = Callable[[pa.Table], list[tuple[Any, ...]]]


def duckdb_apply() -> Iterator[Apply]:
    con = duckdb.connect()
    sql = DuckDBApply()
    cols = ", ".join(f'"{c.name}" {sql.target_type(c.source_type)}' for c in TABLE.columns)
    con.execute(f"create table t ({cols}, primary key (id))")
    con.execute(TRUNCATES_SQL)

    def apply(changes: pa.Table) -> list[tuple[Any, ...]]:
        con.register("staged", changes)
        con.execute("begin")
        for statement in sql.statements("staged", TABLE, "w"):
            con.execute(statement)
        con.execute("commit")
        con.unregister("staged")
        return con.execute("select * from t order by id").fetchall()

    yield apply
    con.close()


def postgres_apply(dsn: str) -> Iterator[Apply]:
    sql: ApplySql = PostgresApply()
    with psycopg.connect(dsn, autocommit=True) as con:
        con.execute("create table t (id integer primary key, v text, big text)")
        con.execute(TRUNCATES_SQL)

        def apply(changes: pa.Table) -> list[tuple[Any, ...]]:
            with con.transaction():
                con.execute(
                    "create temp table staged (namespace text, op text, key text, data text, "
                    "unchanged text, topic text, part bigint, _hw_order bigint, lsn bigint) "
                    "on commit drop"
                )
                with con.cursor().copy("copy staged from stdin") as copy:
                    for row in changes.to_pylist():
                        copy.write_row(list(row.values()))
                for statement in sql.statements("staged", TABLE, "w"):
                    con.execute(statement.encode())
            return con.execute("select * from t order by id").fetchall()

        yield apply


@pytest.fixture(params=["duckdb", pytest.param("postgres", marks=pytest.mark.slow)])
def apply(request: pytest.FixtureRequest) -> Iterator[Apply]:
    if request.param == "duckdb":
        yield from duckdb_apply()
        return
    service: PostgresService = request.getfixturevalue("postgres_service")
    yield from postgres_apply(service.fresh_database(f"apply_{time.monotonic_ns()}"))


def row(i: int, v: str, big: str = "B") -> dict[str, Any]:
    return {"id": i, "v": v, "big": big}


def test_last_change_per_key_and_unchanged_columns(apply: Apply) -> None:
    assert apply(
        batch(
            ("insert", 1, row(1, "a", "BIG1"), None, 0, 0, 10),
            ("insert", 2, row(2, "b"), None, 0, 1, 10),
            ("update", 1, {"id": 1, "v": "a2"}, ["big"], 0, 2, 11),
            ("delete", 2, None, None, 0, 3, 12),
            ("insert", 2, row(2, "b again", None), None, 0, 4, 13),  # type: ignore[arg-type]
        )
    ) == [(1, "a2", "BIG1"), (2, "b again", None)]
    assert apply(batch(("update", 1, {"id": 1, "v": "a3"}, ["big"], 0, 5, 14))) == [
        (1, "a3", "BIG1"),
        (2, "b again", None),
    ]
    assert apply(batch(("delete", 1, None, None, 0, 6, 15))) == [(2, "b again", None)]


def test_a_truncate_split_across_batches_is_applied_once(apply: Apply) -> None:
    apply(batch(("insert", 9, row(9, "old"), None, 1, 0, 5)))
    # partition 0 holds the truncate (LSN 20) and what came after; partition 1 lags behind
    assert apply(
        batch(
            ("insert", 1, row(1, "before"), None, 0, 0, 10),
            ("truncate", None, None, None, 0, 1, 20),
            ("insert", 2, row(2, "after"), None, 0, 2, 30),
            ("update", 9, row(9, "late, before"), None, 1, 1, 8),
        )
    ) == [(2, "after", "B")]
    # partition 1's copy of the truncate and a change after it: no second emptying
    assert apply(
        batch(
            ("update", 9, row(9, "late, still before"), None, 1, 2, 15),
            ("truncate", None, None, None, 1, 3, 20),
            ("insert", 4, row(4, "after too"), None, 1, 4, 40),
        )
    ) == [(2, "after", "B"), (4, "after too", "B")]
    # a second truncate later empties again
    assert apply(
        batch(("truncate", None, None, None, 0, 3, 50), ("insert", 5, row(5, "x"), None, 0, 4, 60))
    ) == [(5, "x", "B")]
