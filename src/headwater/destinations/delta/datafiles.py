"""A task's data files: its rows split by partition value, one Parquet file per value, written
straight to their place in the table under a name that says whose they are
(``<partition>/hw-<writer>-<batch>-<random>.parquet``), with the statistics Delta readers skip
files by. A file is invisible until the driver's commit lists it; what is never committed is
removed by name (``discard``/``clean_staging``) or by ``vacuum``.

What each file needs in the commit travels in its ``StagedPart.meta``: the path relative to
the table (URI-encoded, as the Delta log spells it), its size, partition values and stats.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc

from headwater.destinations.base import DestinationError, StagedPart
from headwater.destinations.batches import part_name, safe_name
from headwater.destinations.delta.config import DEFAULT_PARTITION, EVENT_TIME
from headwater.destinations.delta.storage import Location

if TYPE_CHECKING:
    import duckdb
    from deltalake.transaction import AddAction

FILE_PREFIX = "hw-"
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"  # a null partition value's folder, as Hive names it
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def batch_prefix(writer_id: str, batch_id: int) -> str:
    """The start of every data file name a writer's batch stages."""
    return f"{FILE_PREFIX}{safe_name(writer_id)}-{batch_id:012d}-"


def writer_prefix(writer_id: str) -> str:
    return f"{FILE_PREFIX}{safe_name(writer_id)}-"


def batch_of(name: str, writer_id: str) -> int | None:
    """The batch id in a data file's name, when ``writer_id`` staged it."""
    head = writer_prefix(writer_id)
    if not name.startswith(head):
        return None
    number = name[len(head) :].split("-", 1)[0]
    return int(number) if number.isdigit() else None


_SCRATCH_LOCK = threading.Lock()  # the process's scratch connection, one query at a time


@contextmanager
def scratch() -> Iterator[duckdb.DuckDBPyConnection]:
    """The process's DuckDB connection for small queries (partition values, a mirror's column
    types), one caller at a time: opening one costs ~20 ms, and a task stages every few
    thousand rows."""
    with _SCRATCH_LOCK:
        yield _connection()


@functools.cache
def _connection() -> duckdb.DuckDBPyConnection:
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.execute("SET TimeZone = 'UTC'")
    return con


def partition_values(rows: pa.Table, expression: str, column: str) -> pa.Array:
    """Each row's partition value: ``expression`` (DuckDB SQL over the row's columns); the
    default day is null for rows without an event time (a table whose events have none)."""
    import duckdb

    if expression == DEFAULT_PARTITION and EVENT_TIME not in rows.column_names:
        return pa.nulls(rows.num_rows, pa.date32())
    with scratch() as con:
        con.register("rows", rows)
        try:
            result = con.sql(f"SELECT ({expression}) AS {column} FROM rows").to_arrow_table()
        except duckdb.Error as exc:
            raise DestinationError(
                f"delta: the partition expression {expression!r} failed on a table with "
                f"columns {', '.join(rows.column_names)}: {exc}"
            ) from exc
        finally:
            con.unregister("rows")
    return result.column(0).combine_chunks()


def partition_text(value: Any) -> str | None:
    """A partition value as the Delta log writes it (dates ISO, booleans lower case)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def folder_name(column: str, text: str | None) -> str:
    """``column=value`` with the value escaped as Hive escapes it in folder names."""
    if text is None:
        return f"{column}={NULL_PARTITION}"
    return f"{column}=" + "".join(c if c in _SAFE else f"%{ord(c):02X}" for c in text)


def write_files(
    location: Location,
    table: str,
    name_prefix: str,
    task: str,
    rows: pa.Table,
    partition: tuple[str, str] | None,
    compression: str,
) -> list[StagedPart]:
    """Write ``rows`` (``partition``: ``(expression, column)``) and describe each file."""
    if partition is None:
        return [_write(location, table, name_prefix, task, rows, None, compression)]
    expression, column = partition
    values = partition_values(rows, expression, column)
    data = rows.drop_columns([column]) if column in rows.column_names else rows
    distinct = pc.unique(values)
    parts = []
    for value in distinct:
        chunk = data  # all of them when the rows share one value (one day, mostly)
        if len(distinct) > 1:
            mask = pc.is_null(values) if not value.is_valid else pc.equal(values, value)
            chunk = data.filter(pc.fill_null(mask, False))
        parts.append(
            _write(location, table, name_prefix, task, chunk, (column, value), compression)
        )
    return parts


def _write(
    location: Location,
    table: str,
    name_prefix: str,
    task: str,
    rows: pa.Table,
    partition: tuple[str, pa.Scalar] | None,
    compression: str,
) -> StagedPart:
    import pyarrow.parquet as pq

    values: dict[str, str | None] = {}
    rel = f"{name_prefix}{part_name(task)}.{compression}.parquet"
    if partition is not None:
        column, scalar = partition
        text = partition_text(scalar.as_py())
        values[column] = text
        rel = f"{folder_name(column, text)}/{rel}"
    path = location.path(table, rel)
    fs = location.filesystem()
    if not location.s3:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        pq.write_table(rows, out, compression=compression, write_statistics=False)
        size = out.tell()
    meta = {
        "path": quote(rel, safe="/="),  # the log's URI-encoding of the name
        "size": size,
        "partition": values,
        "stats": json.dumps(stats(rows)),
        "at": int(datetime.now(UTC).timestamp() * 1000),
    }
    return StagedPart(table, rows.num_rows, path, task, meta)


def stats(rows: pa.Table) -> dict[str, Any]:
    """Delta's per-file statistics: rows, and per column nulls, min and max (numbers, booleans
    left out, timestamps in milliseconds, as Delta keeps them; text is left out: its bounds
    would need Delta's truncation rules, and nothing here filters on them)."""
    nulls, low, high = {}, {}, {}
    for name, col in zip(rows.column_names, rows.columns, strict=True):
        nulls[name] = col.null_count
        t = col.type
        if col.null_count == len(col) or not (
            pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_timestamp(t)
        ):
            continue
        bounds = pc.min_max(col)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if isinstance(lo, float) and (lo != lo or hi != hi):  # NaN: no bounds
            continue
        if pa.types.is_timestamp(t):
            lo, hi = _millis(lo), _millis(hi)
        low[name], high[name] = lo, hi
    return {"numRecords": rows.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}


def _millis(at: datetime) -> str:
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def cast_to(rows: pa.Table, target: pa.Schema) -> pa.Table:
    """Rows cast to the table's types, by name (columns the table lacks kept as they are)."""
    for i, f in enumerate(rows.schema):
        if f.name in target.names and f.type != target.field(f.name).type:
            rows = rows.set_column(i, f.name, rows.column(i).cast(target.field(f.name).type))
    return rows


def is_data_file(part: StagedPart) -> bool:
    """A part written by ``write_files`` (a file for the table's log), not rows staged aside."""
    return "path" in part.meta


def add_action(part: StagedPart) -> AddAction:
    from deltalake.transaction import AddAction

    m = part.meta
    return AddAction(m["path"], int(m["size"]), m["partition"], int(m["at"]), True, m["stats"])
