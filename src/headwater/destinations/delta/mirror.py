"""``apply: upsert`` into Delta tables: a PostgreSQL table mirrored by the CDC reader.

The tasks stage a batch's changes (``headwater.transport.apply.CHANGES``) under
``_headwater/staging``. The driver reads them into an in-process DuckDB, which works out what
each table's changes come to, with the same SQL as the DuckDB mirror (``DuckDBApply``): per key
the last change, each column from the last change that carried it. Then one Delta ``MERGE`` per
table applies them: a delete deletes the row; an insert or update writes the row, keeping the
table's value for a column no change in the batch carried (a TOASTed value PostgreSQL did not
send). A table without a key appends its inserts.

Each step is idempotent, as Delta has no transaction across tables:

- A truncate newer than the one recorded empties the table. That delete carries
  ``txn(<writer>/truncate, <its LSN>)``, which records it.
- Each table's merge carries ``txn(<writer>, <batch>)``. A replay finds it and skips the table.
- Then the writer's offsets (``_headwater/offsets/<writer>``) and the ledger are written.

With ``on_error: isolate``, a failing batch is applied again in halves until each bad change is
alone. Those groups carry no ``txn``: upserts are idempotent, but a crash in the middle of
isolating could append a keyless table's inserts twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from headwater.destinations.batches import safe_name
from headwater.destinations.delta.datafiles import cast_to, scratch
from headwater.destinations.delta.errors import classified, classify
from headwater.destinations.delta.storage import BATCH, OWN, WRITER
from headwater.transport.apply import (
    CHANGES_TABLE,
    ORDER,
    TRUNCATES,
    TRUNCATES_SQL,
    DuckDBApply,
    MirrorTable,
    isolate,
    lit,
    q,
)

if TYPE_CHECKING:
    import duckdb
    from deltalake import DeltaTable

    from headwater.destinations.base import StagedPart, TableSchema
    from headwater.destinations.delta.storage import Location

STAGED = "changes"  # the staged changes' name in the driver's DuckDB
_TEXT = ("TIME", "INTERVAL", "UUID", "JSON")  # no such Delta types: kept as text


class DeltaApply(DuckDBApply):
    """DuckDB works out a Delta mirror's values: its types, but text where Delta has none."""

    def target_type(self, source_type: str) -> str:
        t = super().target_type(source_type)
        base, array = t.removesuffix("[]"), t.endswith("[]")
        return ("VARCHAR[]" if array else "VARCHAR") if base in _TEXT else t


def mirror_fields(table: MirrorTable) -> list[pa.Field]:
    """The mirror table's columns as Arrow fields (the types DuckDB gives its values)."""
    sql = DeltaApply()
    null = "CAST(NULL AS VARCHAR)"  # a value's text, as the changes carry it
    picks = ", ".join(f"{sql.typed(null, c.source_type)} AS {q(c.name)}" for c in table.columns)
    with scratch() as con:
        schema = con.sql(f"SELECT {picks}").to_arrow_table().schema
    return [pa.field(f.name, delta_type(f.type)) for f in schema]


def delta_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type Delta keeps for ``t``: time zones as UTC, microseconds."""
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(delta_type(t.value_type))
    if pa.types.is_large_string(t):
        return pa.string()
    return t


def truncate_app(writer_id: str) -> str:
    return f"{writer_id}/truncate"


class DeltaMirror:
    """``apply: upsert`` for ``DeltaDestination`` (its mirror methods)."""

    location: Location

    if TYPE_CHECKING:  # DeltaDestination's

        def _load(self, name: str) -> DeltaTable | None: ...
        def _ensure_fields(
            self, name: str, fields: list[pa.Field], key: tuple[str, ...], upsert: bool
        ) -> TableSchema: ...
        def committed(self, writer_id: str) -> int | None: ...
        def _record(self, writer_id: str, batch_id: int) -> None: ...
        def _remove(self, parts: Sequence[StagedPart]) -> None: ...

    def ensure_mirror(self, table: MirrorTable) -> TableSchema:
        """Create the mirror table (the source's columns, keyed as the source) or add the
        columns it lacks."""
        return self._ensure_fields(table.name, mirror_fields(table), table.key, True)

    # -- offsets ----------------------------------------------------------------------------
    def writer_offsets(self, writer_id: str) -> dict[tuple[str, int], int]:
        """The next offset a mirror writer takes per topic and partition."""
        text = self.location.read_text(OWN, "offsets", safe_name(writer_id))
        marks = json.loads(text) if text else []
        return {(str(t), int(p)): int(o) for t, p, o in marks}

    def mark_offsets(self, writer_id: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Set the writer's next offsets (records below them count as done: skipped)."""
        self._move_offsets(writer_id, offsets, forward_only=False)

    def _move_offsets(
        self, writer_id: str, offsets: Mapping[tuple[str, int], int], forward_only: bool = True
    ) -> None:
        if not offsets:
            return
        marks = self.writer_offsets(writer_id)
        for tp, o in offsets.items():
            marks[tp] = max(marks.get(tp, o), o) if forward_only else o
        body = json.dumps(sorted([t, p, o] for (t, p), o in marks.items()))
        self.location.write_text(body, OWN, "offsets", safe_name(writer_id))

    # -- applying ---------------------------------------------------------------------------
    @contextmanager
    def _changes(self, parts: Sequence[StagedPart]) -> Iterator[duckdb.DuckDBPyConnection]:
        """A DuckDB connection holding the staged changes as ``changes``."""
        import duckdb
        import pyarrow.parquet as pq

        from headwater.transport.apply import CHANGES

        fs = self.location.filesystem()
        tables = [pq.read_table(p.ref, filesystem=fs) for p in parts]
        staged = pa.concat_tables(tables) if tables else CHANGES.empty_table()
        con = duckdb.connect()
        try:
            con.execute("SET TimeZone = 'UTC'")
            con.register("staged_arrow", staged)
            con.execute(f"CREATE TABLE {STAGED} AS SELECT * FROM staged_arrow")
            con.execute(TRUNCATES_SQL)
            yield con
        finally:
            con.close()

    def apply_changes(
        self,
        writer_id: str,
        batch_id: int | None,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> bool:
        """Apply the staged changes to their tables, then move the writer's offsets and record
        the batch (False: recorded before, nothing applied). ``batch_id`` None: a step of
        ``headwater pipeline step`` (no batch). The staging is removed."""
        with classified():
            done = self.committed(writer_id) if batch_id is not None else None
            if batch_id is not None and done is not None and batch_id <= done:
                self._remove(parts)
                return False
            if parts:
                with self._changes(parts) as con:
                    for t in tables:
                        self._apply_table(con, STAGED, t, writer_id, batch_id)
            self._move_offsets(writer_id, offsets or {})
            if batch_id is not None:
                self._record(writer_id, batch_id)
        self._remove(parts)
        return True

    def apply_isolated(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the changes in order in groups (halves, and halves of halves) until every bad
        change is alone; the bad ones back."""
        with classified(), self._changes(parts) as con:
            con.execute(
                f"CREATE TABLE numbered AS SELECT *, row_number() OVER (ORDER BY part, {ORDER}) "
                f"AS _hw_rn FROM {STAGED}"
            )
            (n,) = con.execute("SELECT count(*) FROM numbered").fetchone() or (0,)

            def group(first: int, last: int) -> None:
                one = f"(SELECT * FROM numbered WHERE _hw_rn BETWEEN {first} AND {last})"
                for t in tables:
                    self._apply_table(con, one, t, writer_id, None)

            def where(i: int) -> tuple[str, int, int]:
                row = con.execute(
                    f"SELECT topic, part, {ORDER} FROM numbered WHERE _hw_rn = {i}"
                ).fetchone()
                assert row is not None
                return str(row[0]), int(row[1]), int(row[2])

            failed = isolate(int(n), group, where, classify)
            self._move_offsets(writer_id, offsets or {})
            self._record(writer_id, batch_id)
        self._remove(parts)
        return failed

    def _apply_table(
        self,
        con: duckdb.DuckDBPyConnection,
        source: str,
        t: MirrorTable,
        writer_id: str,
        batch_id: int | None,
    ) -> None:
        from deltalake import CommitProperties, Transaction, write_deltalake

        dt = self._load(t.name)
        assert dt is not None, f"mirror table {t.name} not created"
        if batch_id is not None:
            recorded = dt.transaction_version(writer_id)
            if recorded is not None and recorded >= batch_id:  # a replay: applied already
                return
        self._truncate(con, source, t, writer_id, dt)
        sql = DeltaApply()
        apps = [Transaction(writer_id, batch_id)] if batch_id is not None else None
        meta = {WRITER: writer_id, BATCH: str(batch_id)} if batch_id is not None else None
        commit = CommitProperties(custom_metadata=meta, app_transactions=apps)
        mine = sql.changed(source, t, writer_id)
        target = pa.schema(dt.schema().to_arrow())
        if not t.key:
            rows = con.sql(
                f"SELECT {sql.inserted(t)} FROM ({mine}) m "
                f"WHERE op IN ('read', 'insert') ORDER BY part, {ORDER}"
            ).to_arrow_table()
            if rows.num_rows:
                rows = cast_to(rows.rename_columns([c.name for c in t.columns]), target)
                write_deltalake(dt, rows, mode="append", commit_properties=commit)
            return
        last = sql.last_per_key(mine, t)
        values = [c for c in t.columns if not c.key]
        picks = ["l.op AS _hw_op"]
        picks += [f"{sql.typed_key(t, k)} AS {q(k)}" for k in t.key]
        picks += [f"{sql.typed(f'l.{q(c.name)}', c.source_type)} AS {q(c.name)}" for c in values]
        picks += [f"l.{q('set:' + c.name)} AS _hw_set_{i}" for i, c in enumerate(values)]
        changes = con.sql(f"SELECT {', '.join(picks)} FROM ({last}) l").to_arrow_table()
        if not changes.num_rows:
            return
        source_rows = cast_to(changes, target)
        on = " AND ".join(f"t.`{k}` = s.`{k}`" for k in t.key)
        updates = {
            f"`{c.name}`": f"CASE WHEN s._hw_set_{i} THEN s.`{c.name}` ELSE t.`{c.name}` END"
            for i, c in enumerate(values)
        }
        inserts = {f"`{c.name}`": f"s.`{c.name}`" for c in t.columns}
        merger = dt.merge(
            source_rows, on, source_alias="s", target_alias="t", commit_properties=commit
        ).when_matched_delete("s._hw_op = 'delete'")
        if updates:
            merger = merger.when_matched_update(updates, "s._hw_op <> 'delete'")
        merger.when_not_matched_insert(inserts, "s._hw_op <> 'delete'").execute()

    def _truncate(
        self,
        con: duckdb.DuckDBPyConnection,
        source: str,
        t: MirrorTable,
        writer_id: str,
        dt: DeltaTable,
    ) -> None:
        """Empty the table for a truncate newer than the one recorded, recording it; and tell
        the changes' SQL which truncate is recorded (its ``TRUNCATES`` table)."""
        from deltalake import CommitProperties, Transaction

        app = truncate_app(writer_id)
        recorded = dt.transaction_version(app)
        row = con.execute(f"SELECT {DeltaApply().newest_truncate(source, t)}").fetchone()
        newest = row[0] if row else None
        if newest is not None and newest > (recorded if recorded is not None else -1):
            commit = CommitProperties(app_transactions=[Transaction(app, int(newest))])
            dt.delete(commit_properties=commit)
            dt.update_incremental()
            recorded = int(newest)
        con.execute(
            f"DELETE FROM {TRUNCATES} WHERE writer_id = {lit(writer_id)} "
            f"AND namespace = {lit(t.namespace)}"
        )
        if recorded is not None:
            con.execute(
                f"INSERT INTO {TRUNCATES} VALUES ({lit(writer_id)}, {lit(t.namespace)}, "
                f"{int(recorded)})"
            )


def is_changes(name: str) -> bool:
    """A mirror's staged changes (``Destination.stage`` of ``CHANGES_TABLE``)."""
    return name == CHANGES_TABLE
