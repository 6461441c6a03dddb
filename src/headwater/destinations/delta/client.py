"""Delta Lake (``path``: a local folder, default ``<data_dir>/delta/<id>``, or
``s3a://bucket/prefix``): a Delta table per ``table_name_template``, at ``<path>/<table>``,
written with delta-rs; Spark, DuckDB, Trino and delta-rs read them (docs/delta.md).

Executors write, the driver commits. Each task writes its rows as Parquet files straight into
their partition's folder in the table (``datafiles``), invisible until listed in the log, and
reports each file (path, size, partition values, statistics). The driver commits a batch's
files to each table as one Delta transaction that carries ``txn(appId=<writer>,
version=<batch>)``, Delta's idempotent-write marker, then records the batch in its ledger
(``<path>/_headwater/batches/<writer>``). Delta has no transactions across tables: a batch that
touched two tables and crashed between their commits is replayed, and each table whose log
already holds the writer's batch takes nothing of it (its new files are removed), so every
table gets the batch exactly once.

With a primary key, tasks stage rows (with ``_hw_order``) in ``<path>/_headwater/staging``
and the driver MERGEs them on the key (the batch's last row per key wins) in one transaction
with the same marker; the key is kept in the table's ``headwater.primaryKey`` property.

Tables are partitioned by ``options.partition_by``, by default the event's UTC day in an
``event_date`` column. New columns are added with an ``ADD COLUMNS`` commit of their own before
the batch's (``ensure_table``); a value whose type does not fit its column goes to the sibling
``<column>__<type>`` column, as in every warehouse (the pipeline's typing). ``optimize`` and
``vacuum`` (``maintenance``) keep the small files a stream makes in check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from headwater.destinations.base import (
    ORDER_COLUMN,
    Column,
    Destination,
    DestinationError,
    DestinationUnavailable,
    StagedPart,
    TableSchema,
)
from headwater.destinations.batches import (
    ARROW_TYPES,
    by_table,
    dedupe_last,
    safe_name,
    stage_parquet,
    staged_paths,
    utc_timestamps,
    without_order,
)
from headwater.destinations.delta.config import DeltaOptions
from headwater.destinations.delta.datafiles import (
    add_action,
    batch_of,
    batch_prefix,
    cast_to,
    is_data_file,
    partition_values,
    write_files,
    writer_prefix,
)
from headwater.destinations.delta.dialect import DeltaDialect
from headwater.destinations.delta.errors import classified
from headwater.destinations.delta.mirror import DeltaMirror, is_changes
from headwater.destinations.delta.storage import BATCH, OWN, PRIMARY_KEY, WRITER, Location
from headwater.destinations.types import ColumnType
from headwater.errors import MissingDependencyError

if TYPE_CHECKING:
    from deltalake import DeltaTable

    from headwater.pipeline.config import DestinationConfig

log = logging.getLogger(__name__)
_RETRIES = 8  # table creation and column patching racing other writers


class DeltaDestination(DeltaMirror, Destination):
    kind = "delta"

    def __init__(
        self, location: Location, options: DeltaOptions, primary_key: tuple[str, ...] = ()
    ) -> None:
        self.location = location
        self.options = options
        self.primary_key = primary_key
        self.dialect = DeltaDialect()
        self._tables: dict[str, DeltaTable] = {}
        self._commits: dict[str, int] = {}  # per table, for auto-compaction
        self._just_committed: set[str] = set()  # writers whose last call was a commit

    # -- structure ------------------------------------------------------------------------
    def _load(self, name: str) -> DeltaTable | None:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        dt = self._tables.get(name)
        if dt is not None:
            dt.update_incremental()
            return dt
        try:
            dt = DeltaTable(
                self.location.uri(name), storage_options=self.location.storage_options()
            )
        except TableNotFoundError:
            return None
        self._tables[name] = dt
        return dt

    def delta_table(self, name: str) -> DeltaTable:
        """The table, loaded (maintenance); a clear error when it does not exist."""
        with classified():
            dt = self._load(name)
        if dt is None:
            raise DestinationError(f"delta: no table {name!r} at {self.location.uri(name)}")
        return dt

    def tables(self) -> list[str]:
        """The tables below the root (folders with a Delta log)."""
        with classified():
            names = [n for n in self.location.folders() if n != OWN]
            return [n for n in names if "_delta_log" in self.location.folders(n)]

    def table(self, name: str) -> TableSchema | None:
        with classified():
            dt = self._load(name)
            if dt is None:
                return None
            return self._structure(name, dt)

    def _structure(self, name: str, dt: DeltaTable) -> TableSchema:
        """The table's columns but its partition columns: those are the destination's own,
        computed from the row when its files are written (an event field of that name is
        replaced by the partition value)."""
        cols = {}
        partitions = set(dt.metadata().partition_columns)
        for f in dt.schema().fields:
            if f.name in partitions:
                continue
            sql = _type_name(f.type)
            cols[f.name] = Column(f.name, self.dialect.column_type(sql) or ColumnType.STRING, sql)
        key = (dt.metadata().configuration or {}).get(PRIMARY_KEY)
        return TableSchema(name, cols, tuple(key.split(",")) if key else ())

    def partitioning(self, upsert: bool) -> tuple[str, str] | None:
        expression = self.options.partition_expression(upsert)
        return None if expression is None else (expression, self.options.partition_column)

    def ensure_table(self, schema: TableSchema) -> TableSchema:
        fields = [pa.field(c.name, ARROW_TYPES[c.type]) for c in schema.columns.values()]
        upsert = bool(schema.primary_key)
        return self._ensure_fields(schema.name, fields, schema.primary_key, upsert)

    def _ensure_fields(
        self, name: str, fields: list[pa.Field], key: tuple[str, ...], upsert: bool
    ) -> TableSchema:
        """Create table ``name`` with ``fields`` (keyed by ``key``, partitioned as the options
        say for appends or upserts), or add the fields it lacks; racing writers retried."""
        from deltalake import DeltaTable, Field
        from deltalake.exceptions import CommitFailedError, DeltaError

        partition = self.partitioning(upsert)
        with classified():
            for _ in range(_RETRIES):
                dt = self._load(name)
                try:
                    if dt is None:
                        self._tables[name] = DeltaTable.create(
                            self.location.uri(name),
                            self._arrow_schema(fields, partition),
                            mode="error",
                            partition_by=[partition[1]] if partition else None,
                            configuration={PRIMARY_KEY: ",".join(key)} if key else None,
                            storage_options=self.location.storage_options(),
                            raise_if_key_not_exists=False,  # headwater's own property
                        )
                        continue
                    have = set(dt.schema().to_arrow().names)
                    missing = [f for f in fields if f.name not in have]
                    if not missing:
                        return self._structure(name, dt)
                    dt.alter.add_columns([Field.from_arrow(f) for f in missing])
                except (CommitFailedError, DeltaError) as exc:
                    if not _raced(exc):
                        raise
                    self._tables.pop(name, None)  # another writer got there: look again
            raise DestinationUnavailable(
                f"delta: table {name!r} kept changing under {_RETRIES} attempts to patch it"
            )

    @staticmethod
    def _arrow_schema(fields: list[pa.Field], partition: tuple[str, str] | None) -> pa.Schema:
        names = {f.name for f in fields}
        if partition is not None and partition[1] not in names:
            expression, column = partition
            empty = pa.schema(fields).empty_table()
            fields = [*fields, pa.field(column, partition_values(empty, expression, column).type)]
        return pa.schema(fields)

    # -- the ledger -------------------------------------------------------------------------
    def committed(self, writer_id: str) -> int | None:
        with classified():
            text = self.location.read_text(OWN, "batches", safe_name(writer_id))
        return int(text) if text else None

    def _record(self, writer_id: str, batch_id: int) -> None:
        self.location.write_text(str(batch_id), OWN, "batches", safe_name(writer_id))

    # -- writing ----------------------------------------------------------------------------
    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        done = self.committed(writer_id)
        if done is not None and batch_id <= done:
            return False
        schemas = {name: self._structure(name, self.delta_table(name)) for name in tables}
        parts = self.stage(writer_id, batch_id, "driver", tables, schemas)
        try:
            return self.commit_staged(writer_id, batch_id, parts, schemas)
        except BaseException:
            self.discard_staged(writer_id, batch_id, parts)
            raise

    def stage(
        self,
        writer_id: str,
        batch_id: int,
        task: str,
        tables: Mapping[str, pa.Table],
        schemas: Mapping[str, TableSchema] | None = None,
    ) -> list[StagedPart]:
        parts: list[StagedPart] = []
        with classified():
            for name, rows in tables.items():
                if not rows.num_rows:
                    continue
                key = schemas[name].primary_key if schemas else self.primary_key
                if key or is_changes(name):  # rows to merge, a mirror's changes: staged aside
                    parts += stage_parquet(
                        self.location.path(OWN, "staging"),
                        writer_id,
                        batch_id,
                        task,
                        {name: rows},
                        filesystem=self.location.filesystem(),
                    )
                    continue
                parts.extend(
                    write_files(
                        self.location,
                        name,
                        batch_prefix(writer_id, batch_id),
                        task,
                        utc_timestamps(without_order(rows)),
                        self.partitioning(False),
                        self.options.compression,
                    )
                )
        return parts

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        with classified():
            done = self.committed(writer_id)
            if done is not None and batch_id <= done:
                self._remove(parts)
                return False
            staged_paths(parts, self.location.exists)  # all still there
            for name, table_parts in by_table(parts).items():
                self._commit_table(writer_id, batch_id, name, table_parts)
            self._record(writer_id, batch_id)
            self._just_committed.add(writer_id)
        return True

    def _commit_table(
        self, writer_id: str, batch_id: int, name: str, parts: list[StagedPart]
    ) -> bool:
        """One table's share of the batch as one transaction; False (its parts removed) when
        the table's log holds the writer's batch already."""
        from deltalake import CommitProperties, Transaction

        dt = self.delta_table(name)
        recorded = dt.transaction_version(writer_id)
        if recorded is not None and recorded >= batch_id:  # a replay after a crash mid-batch
            self._remove(parts)
            return False
        commit = CommitProperties(
            custom_metadata={WRITER: writer_id, BATCH: str(batch_id)},
            app_transactions=[Transaction(writer_id, batch_id)],
        )
        if not all(is_data_file(p) for p in parts):  # rows staged to merge
            self._merge(dt, name, parts, commit)
            self._remove(parts)
        else:
            partitions = dt.metadata().partition_columns
            staged = {k for p in parts for k in p.meta["partition"]}
            if staged != set(partitions):
                raise DestinationError(
                    f"delta: table {name!r} is partitioned by {partitions or 'nothing'}, the "
                    f"files were staged by {sorted(staged) or 'nothing'}: options.partition_by "
                    "changed? A table keeps its partitioning; write to a new table"
                )
            dt.create_write_transaction(
                [add_action(p) for p in parts],
                "append",
                dt.schema(),
                partition_by=partitions,
                commit_properties=commit,
            )
        self._after_commit(name, dt, parts)
        return True

    def _merge(self, dt: DeltaTable, name: str, parts: list[StagedPart], commit: Any) -> None:
        import pyarrow.parquet as pq

        have = self._structure(name, dt)
        key = have.primary_key
        if not key:
            raise DestinationError(f"delta: table {name!r} has no primary key to upsert on")
        fs = self.location.filesystem()
        staged = pa.concat_tables(
            [pq.read_table(p.ref, filesystem=fs) for p in parts], promote_options="default"
        )
        rows = dedupe_last(staged.sort_by(ORDER_COLUMN), key).drop_columns([ORDER_COLUMN])
        partition = self.partitioning(True)
        if partition is not None:
            values = partition_values(rows, *partition)
            if partition[1] in rows.column_names:
                rows = rows.drop_columns([partition[1]])
            rows = rows.append_column(partition[1], values)
        target = pa.schema(dt.schema().to_arrow())
        rows = cast_to(rows, target)
        for f in target:  # a column no row of the batch has: null, as an upsert replaces rows
            if f.name not in rows.column_names:
                rows = rows.append_column(f, pa.nulls(rows.num_rows, f.type))
        source = rows.select(target.names)
        on = " AND ".join(f"t.`{k}` = s.`{k}`" for k in key)
        (
            dt.merge(source, on, source_alias="s", target_alias="t", commit_properties=commit)
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    def _after_commit(self, name: str, dt: DeltaTable, parts: list[StagedPart]) -> None:
        every = self.options.auto_compact_every
        if not every:
            return
        self._commits[name] = self._commits.get(name, 0) + 1
        if self._commits[name] % every:
            return
        from headwater.destinations.delta.maintenance import compact

        touched = {tuple(sorted(p.meta.get("partition", {}).items())) for p in parts}
        try:
            dt.update_incremental()  # with this batch's files
            compact(dt, self.options, [dict(t) for t in touched if t])
        except Exception as exc:  # the batch is in; compaction is tried again next time
            log.warning("delta: compacting %s failed: %s", name, exc)

    # -- staging left over ------------------------------------------------------------------
    def _remove(self, parts: Sequence[StagedPart]) -> None:
        self.location.delete([p.ref for p in parts])

    def discard_staged(self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]) -> None:
        with classified():
            self._remove(parts)

    def clean_staging(self, writer_id: str) -> None:
        """Right after a commit: the writer's upsert staging only. Any other time (a writer
        starting, a failed job): also every data file of this writer's batches after its last
        recorded one that no table's log holds. The files of a task attempt that died in a
        batch that then committed are left to ``vacuum`` (they are listed nowhere, so never
        read): finding them would mean listing the partition's folder after every batch."""
        with classified():
            self.location.remove_tree(OWN, "staging", safe_name(writer_id))
            if writer_id in self._just_committed:
                self._just_committed.discard(writer_id)
                return
            self._sweep(writer_id)

    def _sweep(self, writer_id: str) -> None:
        """Remove this writer's files of batches after its ledger's, but those a table's log
        holds (a batch cut between two tables' commits: the replay completes it)."""
        done = self.committed(writer_id)
        head = writer_prefix(writer_id)
        by_table: dict[str, list[tuple[str, int]]] = {}
        for path in self.location.files(prefix=head):
            rel = path[len(self.location.root) + 1 :]
            batch = batch_of(rel.rsplit("/", 1)[-1], writer_id)
            if batch is None or (done is not None and batch <= done):
                continue
            by_table.setdefault(rel.split("/", 1)[0], []).append((path, batch))
        stray = []
        for name, files in by_table.items():
            dt = self._load(name)
            recorded = dt.transaction_version(writer_id) if dt is not None else None
            stray += [p for p, batch in files if recorded is None or batch > recorded]
        if stray:
            log.info("delta: removing %d uncommitted file(s) of writer %s", len(stray), writer_id)
        self.location.delete(stray)

    def close(self) -> None:
        self._tables.clear()


def _raced(exc: BaseException) -> bool:
    """Another writer created the table or changed its metadata first."""
    text = str(exc).lower()
    return any(t in text for t in ("already exists", "concurrent", "conflict", "version"))


def _type_name(t: Any) -> str:
    """A Delta field type's name: a primitive's (``long``, ``decimal(10,2)``), else its kind
    (``array``, ``struct``, ``map``: none of headwater's column types)."""
    kind = getattr(t, "type", None)
    return kind if isinstance(kind, str) else type(t).__name__.removesuffix("Type").lower()


def open_destination(config: DestinationConfig, data_dir: Path) -> DeltaDestination:
    try:
        import deltalake  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError("deltalake", "delta") from exc
    options = DeltaOptions.model_validate(config.options)
    root = str(config.path) if config.path else str(data_dir / "delta" / config.id)
    try:
        location = Location.parse(root, options.storage_options)
    except ValueError as exc:
        raise DestinationError(f"destination {config.id!r}: {exc}") from None
    return DeltaDestination(location, options, tuple(config.primary_key))
