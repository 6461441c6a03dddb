"""Test helpers for destinations: a scratch destination of each kind (a fresh DuckDB file, a
fresh PostgreSQL database, a fresh chdb database, a fresh folder), and reading back what it
holds through a separate connection, as a user would."""

from __future__ import annotations

import re
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from headwater.destinations.base import Destination


def scratch_destination(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path, **extra: Any
) -> dict[str, Any]:
    """A destination config of ``kind`` (id ``wh``) no other test uses."""
    dest: dict[str, Any] = {"id": "wh", "type": kind, **extra}
    if kind == "duckdb":
        dest["path"] = str(tmp_path / "warehouse.duckdb")
    elif kind == "postgres":
        import psycopg

        service = request.getfixturevalue("postgres_service")
        name = f"hw_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(service.dsn, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"'.encode())
        dest["dsn"] = service.dsn.rsplit("/", 1)[0] + "/" + name
    elif kind == "clickhouse":
        dest["path"] = str(request.getfixturevalue("chdb_path"))
        dest["options"] = {"database": f"hw_{uuid.uuid4().hex[:12]}"}
    elif kind == "files":
        dest["path"] = str(tmp_path / "files")
    elif kind == "delta":
        dest["path"] = str(tmp_path / "delta")
    else:
        raise ValueError(f"no scratch destination of kind {kind!r}")
    return dest


def query(destination: Destination, sql: str) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run on what ``destination`` wrote, through a connection of its own
    (for chdb, which allows one embedded server per process, through the destination's)."""
    kind = destination.kind
    if kind == "duckdb":
        import duckdb

        path = destination.path  # type: ignore[attr-defined]
        with closing(duckdb.connect(str(path), read_only=True)) as c:
            return c.execute(sql).fetchall()
    if kind == "postgres":
        import psycopg

        with psycopg.connect(destination.dsn) as c:  # type: ignore[attr-defined]
            return c.execute(sql.encode()).fetchall()
    if kind == "clickhouse":
        return destination.query(qualified(sql, destination))  # type: ignore[attr-defined,no-any-return]
    if kind == "delta":
        return delta_query(destination, sql)
    raise ValueError(f"cannot query a {kind} destination with SQL")


def delta_query(destination: Any, sql: str) -> list[tuple[Any, ...]]:
    """``sql`` over a Delta destination's tables (those named after FROM or JOIN), read by
    delta-rs itself: its own log replay and its DataFusion query engine."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    location = destination.location
    builder = QueryBuilder()
    for name in set(re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", sql, flags=re.IGNORECASE)):
        uri = location.uri(name)
        builder.register(name, DeltaTable(uri, storage_options=location.storage_options()))
    table = pa.table(builder.execute(sql).read_all())
    return [tuple(row.values()) for row in table.to_pylist()]


def qualified(sql: str, destination: Any) -> str:
    """ClickHouse: table names after FROM / TABLE in the destination's database."""
    db = destination.database
    return re.sub(
        r"\b(FROM|TABLE)\s+([`\"]?)(\w+)\2(?!\.)",
        lambda m: f"{m.group(1)} `{db}`.`{m.group(3)}`",
        sql,
        flags=re.IGNORECASE,
    )


def execute_elsewhere(destination: Destination, sql: str) -> None:
    """Run DDL as another writer would, outside the destination's connection."""
    kind = destination.kind
    if kind == "duckdb":
        import duckdb

        destination.close()  # DuckDB: one process writes; ours lets go between batches
        with closing(duckdb.connect(str(destination.path))) as c:  # type: ignore[attr-defined]
            c.execute(sql)
    elif kind == "postgres":
        import psycopg

        with psycopg.connect(destination.dsn, autocommit=True) as c:  # type: ignore[attr-defined]
            c.execute(sql.encode())
    elif kind == "clickhouse":
        destination.query(qualified(sql, destination))  # type: ignore[attr-defined]
    else:
        raise ValueError(f"cannot run SQL on a {kind} destination")


def read_rows(writer: Any, sql: str) -> list[tuple[Any, ...]]:
    """``query`` on a DestinationWriter's destination."""
    return query(writer.destination, sql)


def add_column_elsewhere(writer: Any, table: str, column: str, sql_type: str) -> None:
    d = writer.destination
    if d.kind == "delta":  # another Delta writer: delta-rs's ADD COLUMNS
        from deltalake import DeltaTable, Field

        uri, options = d.location.uri(table), d.location.storage_options()
        DeltaTable(uri, storage_options=options).alter.add_columns(Field(column, sql_type))
        return
    q = d.dialect.quote
    execute_elsewhere(d, f"ALTER TABLE {q(table)} ADD COLUMN {q(column)} {sql_type}")


def delta_leftovers(destination: Any) -> list[str]:
    """Files a Delta destination (local or on S3) staged that no table's current version lists:
    staged, never committed, not cleaned (files that compaction or a MERGE replaced are
    vacuum's). Paths as its ``Location`` names them."""
    from deltalake import DeltaTable

    location = destination.location
    listed: set[str] = set()
    for name in destination.tables():
        dt = DeltaTable(location.uri(name), storage_options=location.storage_options())
        listed.update(uri.split("://", 1)[-1] for uri in dt.file_uris())
    out = []
    for path in location.files():
        parts = path.split("/")
        if "_delta_log" in parts or "batches" in parts or "offsets" in parts:
            continue
        if not parts[-1].startswith("hw-") and "staging" not in parts:
            continue
        if path not in listed:
            out.append(path)
    return sorted(out)
