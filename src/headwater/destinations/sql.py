"""The part of a SQL destination that does not depend on the warehouse: reading a table's
structure, patching it under a lock, and the atomic write of a batch with its ledger row.

A warehouse supplies a ``Session`` (one connection, one transaction at a time) with its
catalog queries, its lock and its bulk load; ``SqlDestination`` does the rest:

- ``write_batch``: in one transaction, insert ``(writer_id, batch_id)`` into the ledger
  ``_headwater_batches`` (a batch already there: roll back, return False), then load every
  table (appending, or upserting on the primary key after a last-row-wins dedupe), commit;
- a load that fails because the table changed underneath (a column gone or added by someone
  else) rolls back, refreshes the structure, patches the table and retries once;
- every other driver error leaves through the warehouse's ``classify`` as a transient or a
  terminal headwater error.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from headwater.destinations.base import Column, Destination, StagedPart, TableSchema
from headwater.destinations.batches import (
    commit_with_ledger,
    dedupe_last,
    schema_of,
    utc_timestamps,
)
from headwater.destinations.session import Session, TableChanged
from headwater.destinations.types import ColumnType
from headwater.errors import HeadwaterError

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.destinations.dialect import Dialect
    from headwater.transport.apply import ApplySql, MirrorTable

LEDGER = "_headwater_batches"


class SqlDestination(Destination):
    # close the connection after every call (DuckDB: let other processes open the file)
    release_after_use: ClassVar[bool] = False

    def __init__(self, dialect: Dialect, ledger_sql: list[str]) -> None:
        self.dialect = dialect
        self._ledger_sql = ledger_sql
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[str, ...]] = {}
        self._ready = False
        self._open: Session | None = None

    @abstractmethod
    def _connect(self) -> Session:
        """A new session on the warehouse."""

    def _session(self) -> Session:
        """The open session (connect on first use, and again after it was lost)."""
        if self._open is None or not self._open.is_open():
            self._open = self._connect()
        return self._open

    @abstractmethod
    def classify(self, exc: BaseException) -> HeadwaterError:
        """A driver error as a transient or terminal headwater error (the connector's rule)."""

    @contextmanager
    def _using(self) -> Iterator[Session]:
        with self._lock:
            try:
                session = self._session()
                if not self._ready:
                    self._create_ledger(session)
                yield session
            except HeadwaterError:
                raise
            except Exception as exc:
                raise self.classify(exc) from exc
            finally:
                if self.release_after_use:
                    self._close()

    def _create_ledger(self, s: Session) -> None:
        s.begin()
        try:
            for sql in self._ledger_sql:
                s.execute(sql)
            s.commit()
        except BaseException:
            s.rollback()
            raise
        self._ready = True

    def table(self, name: str) -> TableSchema | None:
        with self._using() as s:
            return self._read(s, name)

    def _read(self, s: Session, name: str) -> TableSchema | None:
        cols = s.columns(name)
        if not cols:
            return None
        out = {}
        for col, sql in cols:
            kind = self.dialect.column_type(sql)
            out[col] = Column(col, kind or ColumnType.STRING, sql)
        key = s.primary_key(name)
        self._keys[name] = key
        return TableSchema(name, out, key)

    def _key(self, s: Session, name: str) -> tuple[str, ...]:
        """The table's primary key: known from patching or reading it, else from the catalog
        (a destination opened after a restart still upserts)."""
        if name not in self._keys:
            self._read(s, name)
        return self._keys.get(name, ())

    def _staged_keys(
        self, s: Session, tables: Iterable[str], schemas: Mapping[str, TableSchema]
    ) -> dict[str, tuple[str, ...]]:
        """For a commit of staged parts: each table's primary key, its schema's, else the
        catalog's (as ``write_batch``: a table keyed elsewhere)."""
        keys = {t: (schemas[t].primary_key if t in schemas else ()) for t in tables}
        return {t: k or self._key(s, t) for t, k in keys.items()}

    def _repatch(
        self, s: Session, tables: Iterable[str], schemas: Mapping[str, TableSchema]
    ) -> None:
        """Patch each of ``tables`` that has a schema to it again (it changed underneath)."""
        for table in tables:
            if table in schemas:
                self._patch(s, schemas[table])

    def ensure_table(self, schema: TableSchema) -> TableSchema:
        with self._using() as s:
            return self._patch(s, schema)

    def _patch(self, s: Session, schema: TableSchema) -> TableSchema:
        s.begin()
        try:
            s.lock(schema.name)
            have = self._read(s, schema.name)
            if have is None:
                cols = [
                    (c.name, c.sql_type or self.dialect.sql_type(c.type))
                    for c in schema.columns.values()
                ]
                s.execute(self.dialect.create_table_sql(schema.name, cols, schema.primary_key))
            else:
                for c in schema.missing_from(have):
                    sql = c.sql_type or self.dialect.sql_type(c.type)
                    s.execute(self.dialect.add_column_sql(schema.name, c.name, sql))
            after = self._read(s, schema.name)
            s.commit()
        except BaseException:
            s.rollback()
            raise
        assert after is not None
        self._keys[schema.name] = after.primary_key or schema.primary_key
        return after

    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        with self._using() as s:
            for attempt in (1, 2):
                keys = {name: self._key(s, name) for name in tables}
                s.begin()
                try:
                    if not s.record_batch(writer_id, batch_id):
                        s.rollback()
                        return False
                    for name, t in tables.items():
                        rows = dedupe_last(utc_timestamps(t), keys[name])
                        if rows.num_rows:
                            s.load(name, rows, keys[name])
                    s.commit()
                    return True
                except TableChanged:
                    s.rollback()
                    if attempt == 2:
                        raise
                    for name, t in tables.items():
                        self._patch(s, schema_of(name, utc_timestamps(t), keys[name]))
                except BaseException:
                    s.rollback()
                    raise
        return False  # unreachable

    # -- apply: upsert (transport mirrors) ---------------------------------------------------
    def apply_sql(self) -> ApplySql:
        """The apply statements in this warehouse's dialect."""
        raise NotImplementedError(f"{self.kind} destinations cannot mirror tables (apply: upsert)")

    def _changes(self, s: Session, parts: Sequence[StagedPart]) -> str:
        """The staged changes as a relation (a table or a parenthesised query), in the open
        transaction; ``_drop_changes`` ends it."""
        raise NotImplementedError(f"{self.kind} destinations cannot mirror tables (apply: upsert)")

    def _drop_changes(self, s: Session, relation: str) -> None:
        """Drop what ``_changes`` or ``_numbered`` made, if anything."""

    def _numbered(self, s: Session, parts: Sequence[StagedPart]) -> str:
        """The staged changes in order, numbered from 1 (``_hw_rn``), as a relation that
        outlives transactions (until ``_drop_changes``)."""
        raise NotImplementedError(f"{self.kind} destinations cannot mirror tables (apply: upsert)")

    def _chunks(self, rows: int) -> int:
        """In how many parts (by key) a batch of ``rows`` changes is applied."""
        return 1

    def _apply(
        self, s: Session, source: str, tables: Sequence[MirrorTable], writer_id: str, rows: int
    ) -> None:
        """Run the apply statements of every table over ``source``."""
        sql = self.apply_sql()
        chunks = self._chunks(rows)
        for t in tables:
            for statement in sql.truncate_statements(source, t, writer_id):
                s.execute(statement)
            for chunk in range(chunks):
                for statement in sql.row_statements(source, t, writer_id, (chunk, chunks)):
                    s.execute(statement)

    def ensure_mirror(self, table: MirrorTable) -> TableSchema:
        """Create the mirror table (the source's columns, typed for this warehouse, keyed as
        the source) or add the columns it lacks."""
        sql = self.apply_sql()
        columns = {
            c.name: Column(c.name, ColumnType.STRING, sql.target_type(c.source_type))
            for c in table.columns
        }
        return self.ensure_table(TableSchema(table.name, columns, table.key))

    def apply_changes(
        self,
        writer_id: str,
        batch_id: int | None,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> bool:
        """Apply the staged changes to their tables, move the writer's offsets (``offsets``:
        the next offset per topic and partition) and record the batch, in one transaction
        (False: the batch was recorded before; nothing applied). ``batch_id`` None: no batch
        to record (``headwater pipeline step``). The staging is removed."""
        with self._using() as s:

            def move() -> None:
                if parts:
                    source = self._changes(s, parts)
                    self._apply(s, source, tables, writer_id, sum(p.rows for p in parts))
                    self._drop_changes(s, source)
                self._move_offsets(s, writer_id, offsets or {})

            if batch_id is None:
                s.begin()
                try:
                    move()
                    s.commit()
                except BaseException:
                    s.rollback()
                    raise
                done = True
            else:
                done = commit_with_ledger(s, writer_id, batch_id, move, lambda: None)
        self.discard_staged(writer_id, batch_id or 0, parts)
        return done

    def writer_offsets(self, writer_id: str) -> dict[tuple[str, int], int]:
        """The next offset a mirror writer takes per topic and partition (its own offsets: what
        its batches, ``pipeline step`` and ``log set-offset`` moved past)."""
        from headwater.transport.apply import OFFSETS

        with self._using() as s:
            rows = s.execute(
                f"SELECT topic, part, next_offset FROM {OFFSETS} WHERE writer_id = {s.placeholder}",
                (writer_id,),
            )
        return {(str(t), int(p)): int(o) for t, p, o in rows}

    def mark_offsets(self, writer_id: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Set the writer's next offsets (records below them count as done: skipped)."""
        with self._using() as s:
            s.begin()
            try:
                self._move_offsets(s, writer_id, offsets, forward_only=False)
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def _move_offsets(
        self,
        s: Session,
        writer_id: str,
        offsets: Mapping[tuple[str, int], int],
        forward_only: bool = True,
    ) -> None:
        from headwater.transport.apply import OFFSETS

        p = s.placeholder
        for (topic, part), next_offset in offsets.items():
            keep = f"greatest({OFFSETS}.next_offset, excluded.next_offset)"
            s.execute(
                f"INSERT INTO {OFFSETS} VALUES ({p}, {p}, {p}, {p}) ON CONFLICT "
                f"(writer_id, topic, part) DO UPDATE SET next_offset = "
                f"{keep if forward_only else 'excluded.next_offset'}",
                (writer_id, topic, part, next_offset),
            )

    def apply_isolated(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the staged changes in order, a group per transaction: a group that fails is
        split in halves until each bad change is alone. Returns the bad changes (``topic``,
        ``part``, ``offset``, ``code``, ``reason``); records the batch. Applying a prefix of
        the changes again (a crash in between) converges to the same tables."""
        from headwater.transport.apply import isolate

        with self._using() as s:
            s.begin()
            try:
                numbered = self._numbered(s, parts)
                n = int(s.execute(f"SELECT count(*) FROM {numbered} x")[0][0])
                s.commit()
            except BaseException:
                s.rollback()
                raise

            def group(first: int, last: int) -> None:
                one = f"(SELECT * FROM {numbered} g WHERE _hw_rn BETWEEN {first} AND {last})"
                s.begin()
                try:
                    self._apply(s, one, tables, writer_id, last - first + 1)
                    s.commit()
                except BaseException:
                    s.rollback()
                    raise

            def where(i: int) -> tuple[str, int, int]:
                rows = s.execute(
                    f"SELECT topic, part, _hw_order FROM {numbered} x WHERE _hw_rn = {i}"
                )
                return rows[0][0], int(rows[0][1]), int(rows[0][2])

            failed = isolate(n, group, where, self.classify)
            self._drop_changes(s, numbered)
            commit_with_ledger(
                s,
                writer_id,
                batch_id,
                lambda: self._move_offsets(s, writer_id, offsets or {}),
                lambda: None,
            )
        self.discard_staged(writer_id, batch_id, parts)
        return failed

    def committed(self, writer_id: str) -> int | None:
        with self._using() as s:
            rows = s.execute(
                f"SELECT max(batch_id) FROM {self.dialect.quote(LEDGER)} "
                f"WHERE writer_id = {s.placeholder}",
                (writer_id,),
            )
        value = rows[0][0] if rows else None
        return None if value is None else int(value)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None
