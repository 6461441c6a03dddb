"""ClickHouse embedded through chdb (``path``: its data folder, default
``<data_dir>/clickhouse``; ``options.database``, default ``headwater``).

ClickHouse has no transactions, so exactly-once rests on its idempotent insert: every table's
rows go in with ``insert_deduplication_token = "<writer>:<batch>:<table>"`` (tables keep a
deduplication window of 10,000 inserts), squashed into one block so that a replay's insert has
the same token; the ledger row is written last. A crash in between replays the batch, and the
tokens make the repeated inserts no-ops. With a primary key, tables are ReplacingMergeTree
ordered by it (read them with ``FINAL``).

Spark tasks cannot open the data folder (the driver's process holds it), so they stage Parquet
files in ``<path>.staging/<database>/<writer>/<batch>/``; the driver's commit inserts each
table's files (``file(...)``; with a primary key the highest ``_hw_order`` per key) with the same
deduplication tokens, then the ledger row, and deletes the files. The embedded server starts on
the first query, not when the destination is opened (a task never starts one).

chdb runs one embedded server per process, on one data folder: a second folder in the same
process is refused with an error naming both. ClickHouse servers (``dsn``) are refused with a
clear error: there is no ClickHouse server on the test machines, so a server client could not
be tested here (``clickhouse-connect`` would be the way: the same SQL, Arrow inserts).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    ParquetStaging,
    by_table,
    column_type,
    conform,
    dedupe_last,
    remove_files,
    schema_of,
    staged_paths,
    staging_beside,
    utc_timestamps,
)
from headwater.destinations.clickhouse import mirror
from headwater.destinations.clickhouse.dialect import ClickHouseDialect
from headwater.destinations.session import TableChanged
from headwater.destinations.sql import LEDGER
from headwater.destinations.types import ColumnType
from headwater.errors import HeadwaterError
from headwater.transport.apply import MirrorTable, isolate

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.pipeline.config import DestinationConfig

_SESSIONS: dict[str, Any] = {}
_SESSIONS_LOCK = threading.Lock()
_DATABASE_LOCKS: dict[str, threading.RLock] = {}
_CHANGED = ("NO_SUCH_COLUMN_IN_TABLE", "UNKNOWN_TABLE", "THERE_IS_NO_COLUMN")
_TRANSIENT = ("TIMEOUT", "TOO_MANY", "MEMORY_LIMIT_EXCEEDED", "NETWORK_ERROR", "ABORTED")
SQUASH = "min_insert_block_size_rows = 1000000000, min_insert_block_size_bytes = 1000000000000"


def classify(exc: BaseException) -> HeadwaterError:
    """ClickHouse error names tell: timeouts, too many parts or queries, memory limits are
    transient (the server catches up); the rest (bad values, syntax) terminal."""
    text = str(exc)
    if any(s in text for s in _TRANSIENT):
        return DestinationUnavailable(f"ClickHouse: {text}")
    return DestinationError(f"ClickHouse: {text}")


def claim(path: Path) -> str:
    """Reserve ``path`` as this process's chdb folder (refusing a second one) without starting
    the server."""
    key = str(path.resolve())
    with _SESSIONS_LOCK:
        if key not in _SESSIONS:
            if _SESSIONS:
                (other,) = _SESSIONS
                raise DestinationError(
                    f"chdb runs one embedded ClickHouse per process: it is open on {other}, "
                    f"so {key} cannot be opened too"
                )
            _SESSIONS[key] = None
    return key


def embedded_session(path: Path) -> Any:
    """The process's chdb session on ``path`` (started on first use)."""
    from chdb import session

    key = claim(path)
    with _SESSIONS_LOCK:
        if _SESSIONS[key] is None:
            path.mkdir(parents=True, exist_ok=True)
            _SESSIONS[key] = session.Session(key)
            atexit.register(close_embedded)
        return _SESSIONS[key]


def close_embedded() -> None:
    """Stop the process's embedded server while the interpreter is whole. Left to the
    session's ``__del__`` during interpreter teardown, chdb's shutdown can run after its own
    thread pools are gone and the process dies with SIGSEGV after everything succeeded (seen
    at the end of a test run, exit code 139)."""
    with _SESSIONS_LOCK:
        for key, started in list(_SESSIONS.items()):
            if started is not None:
                started.close()
                _SESSIONS[key] = None


def database_lock(path: Path, database: str) -> threading.RLock:
    """One lock per embedded database in this process, so that destinations sharing it patch
    one at a time (re-entrant: a write re-patches while holding it)."""
    key = f"{path.resolve()}:{database}"
    with _SESSIONS_LOCK:
        return _DATABASE_LOCKS.setdefault(key, threading.RLock())


class ClickHouseDestination(ParquetStaging, Destination):
    kind = "clickhouse"

    def __init__(self, path: Path, database: str) -> None:
        self.dialect = ClickHouseDialect()
        self.path = path
        self.database = database
        self._lock = database_lock(path, database)
        self._keys: dict[str, tuple[str, ...]] = {}
        claim(path)
        self._started: Any = None
        self._mirrors_ready = False

    def _session(self) -> Any:
        """The embedded server, with the database and the ledger (made on first use)."""
        if self._started is None:
            started = embedded_session(self.path)
            db = self.dialect.quote(self.database)
            started.query(f"CREATE DATABASE IF NOT EXISTS {db}")
            started.query(
                f"CREATE TABLE IF NOT EXISTS {db}.{LEDGER} (writer_id String, batch_id Int64, "
                "committed_at DateTime64(6, 'UTC')) ENGINE = MergeTree "
                "ORDER BY (writer_id, batch_id)"
            )
            self._started = started
        return self._started

    def query(self, sql: str, hw_rows: pa.Table | None = None) -> list[tuple[Any, ...]]:
        """Run ``sql``; it may read the Arrow table ``hw_rows`` as ``Python(hw_rows)`` (chdb
        finds it among this function's locals)."""
        try:
            result = self._session().query(sql, "ArrowTable")
        except Exception as exc:
            if any(s in str(exc) for s in _CHANGED):
                raise TableChanged(f"ClickHouse: the table changed underneath: {exc}") from exc
            raise classify(exc) from exc
        del hw_rows
        return [tuple(r.values()) for r in result.to_pylist()] if result is not None else []

    def _table_ref(self, name: str) -> str:
        return f"{self.dialect.quote(self.database)}.{self.dialect.quote(name)}"

    def table(self, name: str) -> TableSchema | None:
        rows = self.query(
            "SELECT name, type, is_in_sorting_key FROM system.columns "
            f"WHERE database = '{_lit(self.database)}' AND table = '{_lit(name)}' "
            "ORDER BY position"
        )
        if not rows:
            return None
        cols = {
            str(n): Column(str(n), self.dialect.column_type(str(t)) or ColumnType.STRING, str(t))
            for n, t, _ in rows
        }
        engine = self.query(
            f"SELECT engine FROM system.tables WHERE database = '{_lit(self.database)}' "
            f"AND name = '{_lit(name)}'"
        )
        replacing = bool(engine) and str(engine[0][0]).startswith("Replacing")
        key = tuple(str(n) for n, _, k in rows if k) if replacing else ()
        return TableSchema(name, cols, key)

    def ensure_table(self, schema: TableSchema) -> TableSchema:
        with self._lock:
            have = self.table(schema.name)
            if have is None:
                cols = [
                    (c.name, c.sql_type or self.dialect.sql_type(c.type))
                    for c in schema.columns.values()
                ]
                create = self.dialect.create_table_sql(schema.name, cols, schema.primary_key)
                ref = self._table_ref(schema.name)
                self.query(create.replace(self.dialect.quote(schema.name), ref, 1))
            else:
                for c in schema.missing_from(have):
                    sql = c.sql_type or self.dialect.sql_type(c.type)
                    alter = self.dialect.add_column_sql(schema.name, c.name, sql)
                    ref = self._table_ref(schema.name)
                    self.query(alter.replace(self.dialect.quote(schema.name), ref, 1))
            after = self.table(schema.name)
        assert after is not None
        self._keys[schema.name] = after.primary_key or schema.primary_key
        return after

    def committed(self, writer_id: str) -> int | None:
        rows = self.query(
            f"SELECT max(batch_id), count() FROM {self.dialect.quote(self.database)}.{LEDGER} "
            f"WHERE writer_id = '{_lit(writer_id)}'"
        )
        return int(rows[0][0]) if rows and rows[0][1] else None

    def _recorded(self, writer_id: str, batch_id: int) -> bool:
        rows = self.query(
            f"SELECT count() FROM {self.dialect.quote(self.database)}.{LEDGER} "
            f"WHERE writer_id = '{_lit(writer_id)}' AND batch_id = {int(batch_id)}"
        )
        return bool(rows[0][0])

    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        with self._lock:
            if self._recorded(writer_id, batch_id):
                return False
            for name, batch in tables.items():
                have = self.table(name)
                key = self._keys.setdefault(name, have.primary_key if have else ())
                rows = dedupe_last(conform(utc_timestamps(batch), have, self.dialect), key)
                if rows.num_rows:
                    self._insert(writer_id, batch_id, name, rows)
            self.query(
                f"INSERT INTO {self.dialect.quote(self.database)}.{LEDGER} "
                f"VALUES ('{_lit(writer_id)}', {int(batch_id)}, now64(6))"
            )
        return True

    def _insert(self, writer_id: str, batch_id: int, name: str, rows: pa.Table) -> None:
        cols = ", ".join(self.dialect.quote(c) for c in rows.column_names)
        select = f"SELECT {cols} FROM Python(hw_rows)"
        self._insert_select(writer_id, batch_id, name, rows.column_names, select, rows)

    def _insert_select(
        self,
        writer_id: str,
        batch_id: int,
        name: str,
        columns: list[str],
        select: str,
        rows: pa.Table | None = None,
        schema: TableSchema | None = None,
    ) -> None:
        """One deduplicated insert (token ``<writer>:<batch>:<table>``, squashed into one
        block); a table changed underneath is patched and the insert retried once."""
        cols = ", ".join(self.dialect.quote(c) for c in columns)
        token = _lit(f"{writer_id}:{batch_id}:{name}")
        sql = (
            f"INSERT INTO {self._table_ref(name)} ({cols}) SETTINGS "
            f"insert_deduplication_token = '{token}', insert_deduplicate = 1, {SQUASH} {select}"
        )
        for attempt in (1, 2):
            try:
                self.query(sql, hw_rows=rows)
                return
            except TableChanged:
                if attempt == 2:
                    raise
                if schema is None:
                    assert rows is not None
                    schema = schema_of(name, rows, self._keys.get(name, ()))
                self.ensure_table(schema)

    @property
    def staging(self) -> Path:
        return staging_beside(self.path) / self.database

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        """As ``write_batch``: every table's insert deduplicated by its token, the ledger row
        last; ClickHouse casts a staged column to an explicit type strictly (accurateCast)."""
        import pyarrow.parquet as pq

        with self._lock:
            if self._recorded(writer_id, batch_id):
                remove_files(parts)
                return False
            for name, group in by_table(parts).items():
                paths = staged_paths(group)
                have = self.table(name)
                key = self._keys.setdefault(name, have.primary_key if have else ())
                kinds: dict[str, ColumnType] = {}
                for path in paths:
                    for f in pq.read_schema(path):
                        kinds.setdefault(f.name, column_type(f.type))
                cols = [c for c in kinds if c != ORDER_COLUMN]
                picks = []
                for c in cols:
                    target = have.columns.get(c) if have else None
                    q = self.dialect.quote(c)
                    if (
                        target
                        and target.sql_type
                        and self.dialect.column_type(target.sql_type) != kinds[c]
                    ):
                        picks.append(f"accurateCast({q}, '{_lit(target.sql_type)}')")
                    else:
                        picks.append(q)
                files = " UNION ALL ".join(
                    f"SELECT * FROM file('{_lit(p)}', Parquet)" for p in paths
                )
                select = f"SELECT {', '.join(picks)} FROM ({files})"
                if key:
                    keys = ", ".join(self.dialect.quote(c) for c in key)
                    select += f" ORDER BY {ORDER_COLUMN} DESC LIMIT 1 BY {keys}"
                self._insert_select(
                    writer_id, batch_id, name, cols, select, schema=schemas.get(name)
                )
            self._record(writer_id, batch_id)
        remove_files(parts)
        return True

    # -- apply: upsert (transport mirrors; see clickhouse/mirror.py) ------------------------
    def _mirror_tables(self) -> None:
        """Make the mirrors' own tables (once per destination)."""
        if self._mirrors_ready:
            return
        db = self.dialect.quote(self.database)
        self.query(
            f"CREATE TABLE IF NOT EXISTS {db}.{mirror.TRUNCATES} (writer_id String, "
            "namespace String, lsn Int64) ENGINE = ReplacingMergeTree(lsn) "
            "ORDER BY (writer_id, namespace)"
        )
        self.query(
            f"CREATE TABLE IF NOT EXISTS {db}.{mirror.OFFSETS_TABLE} (writer_id String, "
            "topic String, part Int64, next_offset Int64) ENGINE = "
            "ReplacingMergeTree(next_offset) ORDER BY (writer_id, topic, part)"
        )
        self._mirrors_ready = True

    def ensure_mirror(self, table: MirrorTable) -> TableSchema:
        """Create the mirror table, or add the columns it lacks."""
        with self._lock:
            self._mirror_tables()
            ref = self._table_ref(table.name)
            have = self.table(table.name)
            if have is None:
                self.query(mirror.create_sql(ref, table))
            else:
                for c in table.columns:
                    if c.name not in have.columns:
                        self.query(
                            f"ALTER TABLE {ref} ADD COLUMN IF NOT EXISTS "
                            f"{mirror.q(c.name)} {mirror.column_sql(c)}"
                        )
            after = self.table(table.name)
        assert after is not None
        return after

    def writer_offsets(self, writer_id: str) -> dict[tuple[str, int], int]:
        with self._lock:
            self._mirror_tables()
            rows = self.query(
                f"SELECT topic, part, max(next_offset) FROM "
                f"{self.dialect.quote(self.database)}.{mirror.OFFSETS_TABLE} "
                f"WHERE writer_id = '{_lit(writer_id)}' GROUP BY topic, part"
            )
        return {(str(t), int(p)): int(o) for t, p, o in rows}

    def mark_offsets(self, writer_id: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Move the writer's offsets forward (ClickHouse keeps the highest)."""
        if not offsets:
            return
        with self._lock:
            self._mirror_tables()
            values = ", ".join(
                f"('{_lit(writer_id)}', '{_lit(t)}', {int(p)}, {int(o)})"
                for (t, p), o in offsets.items()
            )
            self.query(
                f"INSERT INTO {self.dialect.quote(self.database)}.{mirror.OFFSETS_TABLE} "
                f"VALUES {values}"
            )

    def apply_changes(
        self,
        writer_id: str,
        batch_id: int | None,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> bool:
        """Apply the staged changes (see clickhouse/mirror.py); each step idempotent, the
        ledger row last. ``batch_id`` None: a step (no ledger row)."""
        with self._lock:
            if batch_id is not None and self._recorded(writer_id, batch_id):
                remove_files(parts)
                return False
            if parts:
                source = self._staged_source(parts)
                tag = f"{writer_id}:{batch_id}" if batch_id is not None else None
                for t in tables:
                    self._apply_table(source, t, writer_id, batch_id, tag)
            self.mark_offsets(writer_id, offsets or {})
            if batch_id is not None:
                self._record(writer_id, batch_id)
        remove_files(parts)
        return True

    def apply_isolated(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the changes in order in groups (halves, and halves of halves), each one
        deduplicated insert per table, until every bad change is alone; the bad ones back."""
        with self._lock:
            source = self._staged_source(parts)
            numbered = (
                f"(SELECT *, row_number() OVER (ORDER BY part, {mirror.ORDER}) AS _hw_rn "
                f"FROM {source} n)"
            )
            n = int(self.query(f"SELECT count() FROM {source} x")[0][0])

            def group(first: int, last: int) -> None:
                one = f"(SELECT * FROM {numbered} g WHERE _hw_rn BETWEEN {first} AND {last})"
                tag = f"{writer_id}:{batch_id}:g{first}-{last}"
                for t in tables:
                    self._apply_table(one, t, writer_id, batch_id, tag, rank_from=first)

            def where(i: int) -> tuple[str, int, int]:
                row = self.query(
                    f"SELECT topic, part, {mirror.ORDER} FROM {numbered} x WHERE _hw_rn = {i}"
                )[0]
                return str(row[0]), int(row[1]), int(row[2])

            failed = isolate(n, group, where, classify)
            self.mark_offsets(writer_id, offsets or {})
            self._record(writer_id, batch_id)
        remove_files(parts)
        return failed

    def _staged_source(self, parts: Sequence[StagedPart]) -> str:
        files = " UNION ALL ".join(
            f"SELECT * FROM file('{_lit(p)}', Parquet)" for p in staged_paths(parts)
        )
        return f"({files})"

    def _apply_table(
        self,
        source: str,
        t: MirrorTable,
        writer_id: str,
        batch_id: int | None,
        tag: str | None,
        rank_from: int = 1,
    ) -> None:
        db = self.dialect.quote(self.database)
        ref = self._table_ref(t.name)
        newest_sql, recorded_sql, record = mirror.truncate_statements(source, t, ref, db, writer_id)
        newest = self.query(newest_sql)[0][0]
        recorded = self.query(recorded_sql)[0][0]
        if newest is not None and (recorded is None or int(newest) > int(recorded)):
            self.query(f"TRUNCATE TABLE {ref}")
            self.query(f"{record}{int(newest)})")
            recorded = newest
        since = max(int(x) for x in (newest or -1, recorded or -1))
        if batch_id is None:  # a step: above its batch's rows, below the next batch's
            done = self.committed(writer_id)
            base = ((0 if done is None else done + 1) << mirror.BATCH_SHIFT) + mirror.STEP_BASE
            select = mirror.rows_select(source, t, ref, since, base, rank=False)
            token = f"{writer_id}:step:{t.name}:{unique_token()}"
        else:
            base = (batch_id + 1) << mirror.BATCH_SHIFT
            select = mirror.rows_select(source, t, ref, since, base + rank_from - 1)
            token = f"{tag}:{t.name}"
        cols = ", ".join(mirror.q(c) for c in mirror.insert_columns(t))
        self.query(
            f"INSERT INTO {ref} ({cols}) SETTINGS insert_deduplication_token = "
            f"'{_lit(token)}', insert_deduplicate = 1, join_use_nulls = 0, "
            f"short_circuit_function_evaluation = 'force_enable', {SQUASH} {select}"
        )

    def _record(self, writer_id: str, batch_id: int) -> None:
        self.query(
            f"INSERT INTO {self.dialect.quote(self.database)}.{LEDGER} "
            f"VALUES ('{_lit(writer_id)}', {int(batch_id)}, now64(6))"
        )

    def close(self) -> None:
        """The embedded server stays up for the process (chdb allows one)."""


def unique_token() -> str:
    """A token no earlier insert used (a step's rows are always new)."""
    import uuid

    return uuid.uuid4().hex


def _lit(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


def open_destination(config: DestinationConfig, data_dir: Path) -> ClickHouseDestination:
    if config.dsn:
        raise DestinationError(
            f"destination {config.id!r}: ClickHouse servers (dsn {config.dsn!r}) are not "
            "supported: without a server to test against here there is no server client; "
            "use the embedded ClickHouse (chdb) with path"
        )
    path = Path(config.path) if config.path else data_dir / "clickhouse"
    return ClickHouseDestination(path, str(config.options.get("database", "headwater")))
