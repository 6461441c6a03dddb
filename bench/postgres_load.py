"""Benchmark of the PostgreSQL destination's bulk path, and the alternatives it was chosen over.

Run from the repository root::

    .venv/bin/python bench/postgres_load.py                 # 100k rows, 3 rounds; about a minute
    .venv/bin/python bench/postgres_load.py --rows 500000 --format json

It starts a throwaway PostgreSQL 15 cluster on a free loopback port (``headwater.testing``) and
loads the same Arrow table (``--rows`` rows of event-shaped columns: text ids, an integer, a
float, a boolean, a timestamp, a nullable text) into a fresh table, in the same run, by:

* ``headwater``: the destination's ``write_batch`` (CSV made by Arrow's C++ writer, one
  ``COPY ... FROM STDIN (FORMAT csv)``, and the batch ledger in the same transaction);
* ``arrow csv copy``: the same COPY without the destination around it (its own cost);
* ``copy write_row``: psycopg's ``COPY`` with ``write_row`` per row (text format);
* ``copy binary``: the same in binary format, with the column types given;
* ``executemany``: ``INSERT ... VALUES (%s, ...)`` with psycopg's ``executemany`` (pipelined).

Figures: rows/s per path (the median of ``--rounds``), and each as a ratio to ``executemany``,
the usual way a Python loader inserts. The server shares this machine's cores with the client.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from _common import emit_json, fmt_number, machine_info, median, print_table, progress
from headwater.destinations.base import Column, TableSchema
from headwater.destinations.postgres.client import PostgresDestination, to_csv
from headwater.destinations.types import ColumnType as T
from headwater.testing.postgres import start_postgres

COLUMNS = {
    "event_id": T.STRING,
    "user_id": T.STRING,
    "quantity": T.INT64,
    "price": T.FLOAT64,
    "in_stock": T.BOOL,
    "received_at": T.TIMESTAMP,
    "referrer": T.STRING,
}
SQL_TYPES = {
    T.STRING: "text",
    T.INT64: "bigint",
    T.FLOAT64: "double precision",
    T.BOOL: "boolean",
    T.TIMESTAMP: "timestamptz",
}


def make_rows(n: int) -> pa.Table:
    start = datetime(2024, 5, 1, tzinfo=UTC)
    return pa.table(
        {
            "event_id": pa.array([f"ev-{i:09d}" for i in range(n)]),
            "user_id": pa.array([f"u-{i % 50_000}" for i in range(n)]),
            "quantity": pa.array([i % 5 + 1 for i in range(n)], pa.int64()),
            "price": pa.array([(i % 50_000) / 100 for i in range(n)], pa.float64()),
            "in_stock": pa.array([i % 3 != 0 for i in range(n)]),
            "received_at": pa.array(
                [start + timedelta(milliseconds=i) for i in range(n)], pa.timestamp("us", "UTC")
            ),
            "referrer": pa.array(
                [None if i % 4 else 'https://news.example.com/a,b "q"' for i in range(n)]
            ),
        }
    )


def create_table(con: psycopg.Connection[Any], name: str) -> None:
    cols = ", ".join(f"{c} {SQL_TYPES[t]}" for c, t in COLUMNS.items())
    con.execute(f"DROP TABLE IF EXISTS {name}")
    con.execute(f"CREATE TABLE {name} ({cols})")
    con.commit()


def count(con: psycopg.Connection[Any], name: str) -> int:
    row = con.execute(f"SELECT count(*) FROM {name}").fetchone()
    assert row is not None
    return int(row[0])


def via_destination(dsn: str, rows: pa.Table, name: str, batch_id: int) -> None:
    with PostgresDestination(dsn) as d:
        schema = TableSchema(name, {c: Column(c, t) for c, t in COLUMNS.items()})
        d.ensure_table(schema)
        d.write_batch("bench", batch_id, {name: rows})


def via_arrow_csv(con: psycopg.Connection[Any], rows: pa.Table, name: str) -> None:
    cols = ", ".join(rows.column_names)
    with con.cursor().copy(f"COPY {name} ({cols}) FROM STDIN (FORMAT csv)") as copy:
        copy.write(to_csv(rows))
    con.commit()


def via_write_row(con: psycopg.Connection[Any], rows: pa.Table, name: str, *, binary: bool) -> None:
    cols = ", ".join(rows.column_names)
    fmt = " (FORMAT binary)" if binary else ""
    with con.cursor().copy(f"COPY {name} ({cols}) FROM STDIN{fmt}") as copy:
        if binary:
            copy.set_types([SQL_TYPES[COLUMNS[c]] for c in rows.column_names])
        for row in zip(*(rows.column(c).to_pylist() for c in rows.column_names), strict=True):
            copy.write_row(row)
    con.commit()


def via_executemany(con: psycopg.Connection[Any], rows: pa.Table, name: str) -> None:
    cols = ", ".join(rows.column_names)
    marks = ", ".join(["%s"] * rows.num_columns)
    values = list(zip(*(rows.column(c).to_pylist() for c in rows.column_names), strict=True))
    with con.cursor() as cur:
        cur.executemany(f"INSERT INTO {name} ({cols}) VALUES ({marks})", values)
    con.commit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()

    rows = make_rows(args.rows)
    out: dict[str, Any] = {"machine": machine_info(Path(".")), "rows": args.rows, "paths": {}}
    progress(f"starting PostgreSQL; {args.rows:,} rows x {rows.num_columns} columns per load")
    with start_postgres() as pg, psycopg.connect(pg.dsn) as con:
        paths: dict[str, Callable[[str, int], None]] = {
            "headwater": lambda name, i: via_destination(pg.dsn, rows, name, i),
            "arrow csv copy": lambda name, i: via_arrow_csv(con, rows, name),
            "copy write_row": lambda name, i: via_write_row(con, rows, name, binary=False),
            "copy binary": lambda name, i: via_write_row(con, rows, name, binary=True),
            "executemany": lambda name, i: via_executemany(con, rows, name),
        }
        seconds: dict[str, list[float]] = {p: [] for p in paths}
        for round_ in range(args.rounds):
            for i, (path, load) in enumerate(paths.items()):
                name = f"load_{i}"
                if path != "headwater":
                    create_table(con, name)
                else:
                    con.execute(f"DROP TABLE IF EXISTS {name}")
                    con.execute("DROP TABLE IF EXISTS _headwater_batches")
                    con.commit()
                t0 = time.perf_counter()
                load(name, round_)
                seconds[path].append(time.perf_counter() - t0)
                got = count(con, name)
                if got != args.rows:
                    raise SystemExit(f"{path}: {got:,} rows landed, expected {args.rows:,}")
                progress(f"round {round_ + 1}: {path}: {seconds[path][-1]:.2f} s")
    for path, runs in seconds.items():
        best = median(runs)
        out["paths"][path] = {"seconds": best, "rows_per_s": args.rows / best, "runs": runs}
    reference = out["paths"]["executemany"]["rows_per_s"]
    for figures in out["paths"].values():
        figures["x_executemany"] = figures["rows_per_s"] / reference
    if args.format == "json":
        emit_json(out)
        return
    print(f"machine: {out['machine']}")
    table = [
        [p, f"{f['seconds']:.3f}", fmt_number(f["rows_per_s"]), f"{f['x_executemany']:.1f}x"]
        for p, f in out["paths"].items()
    ]
    print(print_table(["path", "seconds", "rows/s", "x executemany"], table))


if __name__ == "__main__":
    sys.exit(main())
