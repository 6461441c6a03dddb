"""Arrow helpers every destination shares: the structure a batch implies, UTC timestamps,
strict casts to a table's types, and the last-row-wins dedupe on a primary key; and what staging
destinations share (``Destination.stage``): unique part names, Parquet parts in a staging
folder, and a SQL batch's transaction with its ledger row."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from headwater.destinations.base import (
    ORDER_COLUMN,
    Column,
    DestinationError,
    DestinationUnavailable,
    StagedPart,
    TableSchema,
)
from headwater.destinations.session import TableChanged
from headwater.destinations.types import ColumnType

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from headwater.destinations.dialect import Dialect
    from headwater.destinations.session import Session

_UNSAFE = re.compile(r"[^0-9A-Za-z_.-]")

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


# -- staging ----------------------------------------------------------------------------------
def safe_name(text: str) -> str:
    """``text`` usable as a file or table name part (writer ids, task names)."""
    return _UNSAFE.sub("_", text) or "_"


def part_name(task: str) -> str:
    """A staged part's name: the task for logs, and a random suffix that no other call (a
    retried or speculative attempt, the same task's next chunk) can have."""
    return f"{uuid.uuid4().hex[:12]}-{safe_name(task)}"


def by_table(parts: Sequence[StagedPart]) -> dict[str, list[StagedPart]]:
    out: dict[str, list[StagedPart]] = {}
    for part in parts:
        out.setdefault(part.table, []).append(part)
    return out


def with_order(rows: pa.Table) -> pa.Table:
    """``rows`` with ``ORDER_COLUMN``: their positions when the caller gave none."""
    if ORDER_COLUMN in rows.column_names:
        return rows
    return rows.append_column(ORDER_COLUMN, pa.array(range(rows.num_rows), pa.int64()))


def without_order(rows: pa.Table) -> pa.Table:
    return rows.drop_columns([ORDER_COLUMN]) if ORDER_COLUMN in rows.column_names else rows


def stage_parquet(
    folder: Path | str,
    writer_id: str,
    batch_id: int,
    task: str,
    tables: Mapping[str, pa.Table],
    *,
    keep_order: bool = True,
    filesystem: pafs.FileSystem | None = None,
) -> list[StagedPart]:
    """Write each table's rows to ``<folder>/<writer>/<batch>/<table>/<part>.parquet`` (on
    ``filesystem``: the local one unless given); a part is only ever listed after its file is
    complete, so a half-written file (a task that died) is never committed, only cleaned up."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs = filesystem or pafs.LocalFileSystem()
    parts = []
    for name, rows in tables.items():
        if not rows.num_rows:
            continue
        rows = utc_timestamps(with_order(rows) if keep_order else without_order(rows))
        table_folder = "/".join((str(folder), safe_name(writer_id), str(batch_id), name))
        path = f"{table_folder}/{part_name(task)}.parquet"
        if isinstance(fs, pafs.LocalFileSystem):  # (object stores have no folders to make)
            fs.create_dir(table_folder, recursive=True)
        with fs.open_output_stream(path) as out:
            pq.write_table(rows, out, write_statistics=False)  # read once, whole: no use
        parts.append(StagedPart(name, rows.num_rows, path, task))
    return parts


def staging_beside(path: Path) -> Path:
    """Where a destination kept in ``path`` (a file or a folder) stages: ``<path>.staging``."""
    return path.with_name(path.name + ".staging")


class ParquetStaging:
    """``Destination.stage``, ``discard_staged`` and ``clean_staging`` for a destination whose
    tasks stage Parquet files in its ``staging`` folder, for its driver's commit to read."""

    @property
    def staging(self) -> Path:
        raise NotImplementedError

    def stage(
        self, writer_id: str, batch_id: int, task: str, tables: Mapping[str, pa.Table]
    ) -> list[StagedPart]:
        return stage_parquet(self.staging, writer_id, batch_id, task, tables)

    def discard_staged(self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]) -> None:
        remove_files(parts)

    def clean_staging(self, writer_id: str) -> None:
        remove_writer_staging(self.staging, writer_id)


def writer_folder(folder: Path, writer_id: str) -> Path:
    return folder / safe_name(writer_id)


def staged_paths(
    parts: Sequence[StagedPart], exists: Callable[[list[str]], list[bool]] | None = None
) -> list[str]:
    """The parts' files, all of which must still be there (else the batch must be staged
    again: transient, the batch's retry does it); ``exists``: where they are not local files."""
    refs = [p.ref for p in parts]
    found = exists(refs) if exists is not None else [Path(r).exists() for r in refs]
    missing = [r for r, ok in zip(refs, found, strict=True) if not ok]
    if missing:
        raise DestinationUnavailable(
            f"{len(missing)} staged part(s) are gone (cleaned up?), e.g. {missing[0]}: "
            "the batch must be staged again"
        )
    return refs


def remove_files(parts: Sequence[StagedPart]) -> None:
    """Delete the parts' files and the folders they leave empty (up to the writer's)."""
    folders = set()
    for part in parts:
        path = Path(part.ref)
        path.unlink(missing_ok=True)
        folders.update((path.parent, path.parent.parent))
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: another part is still there
            folder.rmdir()


def remove_writer_staging(folder: Path, writer_id: str) -> None:
    shutil.rmtree(writer_folder(folder, writer_id), ignore_errors=True)


def commit_with_ledger(
    session: Session,
    writer_id: str,
    batch_id: int,
    move: Callable[[], None],
    repatch: Callable[[], None],
) -> bool:
    """One SQL transaction: the ledger row (already there: roll back, False), then ``move``;
    when ``move`` finds a table changed underneath, roll back, ``repatch`` and retry once."""
    for attempt in (1, 2):
        session.begin()
        try:
            if not session.record_batch(writer_id, batch_id):
                session.rollback()
                return False
            move()
            session.commit()
            return True
        except TableChanged:
            session.rollback()
            if attempt == 2:
                raise
            repatch()
        except BaseException:
            session.rollback()
            raise
    return False  # unreachable


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
