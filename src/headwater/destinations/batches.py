"""Arrow helpers every destination shares: the structure a batch implies, UTC timestamps,
strict casts to a table's types, and the last-row-wins dedupe on a primary key."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from headwater.destinations.base import Column, DestinationError, TableSchema
from headwater.destinations.types import ColumnType

if TYPE_CHECKING:
    from headwater.destinations.dialect import Dialect

ARROW_TYPES: dict[ColumnType, pa.DataType] = {
    ColumnType.BOOL: pa.bool_(),
    ColumnType.INT64: pa.int64(),
    ColumnType.FLOAT64: pa.float64(),
    ColumnType.TIMESTAMP: pa.timestamp("us", tz="UTC"),
    ColumnType.STRING: pa.string(),
}


def column_type(t: pa.DataType) -> ColumnType:
    """The ColumnType of an Arrow column (anything unexpected is kept as text)."""
    if pa.types.is_boolean(t):
        return ColumnType.BOOL
    if pa.types.is_integer(t):
        return ColumnType.INT64
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return ColumnType.FLOAT64
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return ColumnType.TIMESTAMP
    return ColumnType.STRING


def schema_of(name: str, table: pa.Table, primary_key: tuple[str, ...] = ()) -> TableSchema:
    """The structure a batch's Arrow table implies (used to re-patch a table that changed)."""
    cols = {f.name: Column(f.name, column_type(f.type)) for f in table.schema}
    return TableSchema(name, cols, primary_key)


def utc_timestamps(table: pa.Table) -> pa.Table:
    """Timestamps as ``timestamp[us, tz=UTC]`` (Spark hands naive UTC values)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type) and (f.type.tz is None or f.type.unit != "us"):
            col = table.column(i)
            if f.type.tz is None:
                col = pc.assume_timezone(col, "UTC") if len(col) else col.cast(f.type)
            table = table.set_column(i, f.name, col.cast(pa.timestamp("us", tz="UTC")))
    return table


def conform(rows: pa.Table, have: TableSchema | None, dialect: Dialect) -> pa.Table:
    """Cast the batch's columns to the Arrow types of the table's columns (those of our types),
    refusing any cast that loses a value: a warehouse that quietly stores NULL for a value it
    cannot parse (ClickHouse does, into Nullable columns) is only handed values that fit."""
    if have is None:
        return rows
    for i, f in enumerate(rows.schema):
        col = have.columns.get(f.name)
        kind = dialect.column_type(col.sql_type) if col and col.sql_type else None
        if kind is None or f.type == ARROW_TYPES[kind]:
            continue
        try:
            cast = rows.column(i).cast(ARROW_TYPES[kind], safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise DestinationError(
                f"table {have.name!r}, column {f.name!r}: {f.type} values do not fit the "
                f"column's type {col.sql_type}: {exc}"  # type: ignore[union-attr]
            ) from exc
        rows = rows.set_column(i, f.name, cast)
    return rows


def dedupe_last(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Keep, for each primary key, only the last row of the batch."""
    if not keys or table.num_rows < 2:
        return table
    numbered = table.append_column("__hw_row", pa.array(range(table.num_rows), pa.int64()))
    last = numbered.group_by(list(keys), use_threads=False).aggregate([("__hw_row", "max")])
    keep = pc.sort_indices(last.column("__hw_row_max"))
    return table.take(pc.take(last.column("__hw_row_max"), keep))
