"""DuckDB: a database file (``path``, default ``<data_dir>/warehouse.duckdb``).

Rows go in straight from Arrow (``INSERT ... BY NAME`` from the registered batch), upserts with
``INSERT OR REPLACE``. Spark tasks stage Parquet files in ``<path>.staging/<writer>/<batch>/``
without opening the database (one process writes a DuckDB file); the driver's commit reads them
all with ``read_parquet`` in the transaction that records the batch, then deletes them.

The file is opened for each call and closed after it, so that other
processes (a user's ``duckdb`` shell, a BI tool) can read it between writes; while another
process holds the file, opening is retried for ``options.lock_timeout_s`` (default 30 s).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from headwater.destinations.base import (
    ORDER_COLUMN,
    DestinationError,
    DestinationUnavailable,
    StagedPart,
    TableSchema,
)
from headwater.destinations.batches import (
    ParquetStaging,
    by_table,
    commit_with_ledger,
    remove_files,
    staged_paths,
    staging_beside,
)
from headwater.destinations.duckdb.dialect import DuckDBDialect
from headwater.destinations.session import Session, TableChanged
from headwater.destinations.sql import LEDGER, SqlDestination
from headwater.errors import HeadwaterError
from headwater.transport.apply import OFFSETS_SQL, TRUNCATES_SQL

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.pipeline.config import DestinationConfig
    from headwater.transport.apply import ApplySql

LEDGER_SQL = [
    f"CREATE TABLE IF NOT EXISTS {LEDGER} (writer_id VARCHAR, batch_id BIGINT, "
    "committed_at TIMESTAMP WITH TIME ZONE, PRIMARY KEY (writer_id, batch_id))",
    TRUNCATES_SQL,
    OFFSETS_SQL,
]
_CHANGED = ("does not have a column", "not found in", "does not exist")
_FILE_LOCKS: dict[str, threading.Lock] = {}
_FILE_LOCKS_GUARD = threading.Lock()


def file_lock(path: Path) -> threading.Lock:
    """One lock per database file in this process: every destination writing to the file (two
    destinations may share it) patches and writes one at a time."""
    key = str(path.resolve())
    with _FILE_LOCKS_GUARD:
        return _FILE_LOCKS.setdefault(key, threading.Lock())


def classify(exc: BaseException) -> HeadwaterError:
    """A DuckDB error as headwater's: a file held by another process and a write-write conflict
    between transactions are transient (a retry may succeed), the rest terminal."""
    text = str(exc)
    if isinstance(exc, duckdb.IOException) and "lock" in text.lower():
        return DestinationUnavailable(f"the DuckDB file is locked by another process: {text}")
    if isinstance(exc, duckdb.TransactionException) and "conflict" in text.lower():
        return DestinationUnavailable(f"DuckDB: a concurrent transaction conflicted: {text}")
    return DestinationError(f"DuckDB: {text}")


class DuckDBSession(Session):
    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cur = self.con.execute(sql, list(params))
        try:
            return cur.fetchall()
        except duckdb.InvalidInputError:  # a statement without a result
            return []

    def begin(self) -> None:
        self.con.begin()

    def commit(self) -> None:
        self.con.commit()

    def rollback(self) -> None:
        with contextlib.suppress(duckdb.TransactionException):  # none active
            self.con.rollback()

    def columns(self, table: str) -> list[tuple[str, str]]:
        rows = self.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
            (table,),
        )
        return [(str(n), str(t)) for n, t in rows]

    def primary_key(self, table: str) -> tuple[str, ...]:
        rows = self.execute(
            "SELECT constraint_column_names FROM duckdb_constraints() "
            "WHERE table_name = ? AND constraint_type = 'PRIMARY KEY'",
            (table,),
        )
        return tuple(rows[0][0]) if rows else ()

    def lock(self, table: str) -> None:
        """DuckDB has one writing process; the destination's own lock orders its threads."""

    def load(self, table: str, rows: pa.Table, primary_key: tuple[str, ...]) -> None:
        self.con.register("__hw_rows", rows)
        try:
            self._insert(table, "SELECT * FROM __hw_rows", primary_key)
        finally:
            with contextlib.suppress(duckdb.Error):  # fails in an aborted transaction
                self.con.unregister("__hw_rows")

    def load_staged(self, table: str, paths: list[str], primary_key: tuple[str, ...]) -> None:
        """Insert the staged Parquet files' rows; with a primary key, the highest order wins."""
        files = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
        select = (
            f"SELECT * EXCLUDE ({ORDER_COLUMN}) FROM read_parquet([{files}], union_by_name = true)"
        )
        if primary_key:
            keys = ", ".join(f'"{c}"' for c in primary_key)
            select += (
                f" QUALIFY row_number() OVER (PARTITION BY {keys} ORDER BY {ORDER_COLUMN} DESC) = 1"
            )
        self._insert(table, select, primary_key)

    def _insert(self, table: str, select: str, primary_key: tuple[str, ...]) -> None:
        verb = "INSERT OR REPLACE INTO" if primary_key else "INSERT INTO"
        try:
            self.con.execute(f'{verb} "{table}" BY NAME {select}')
        except (duckdb.BinderException, duckdb.CatalogException) as exc:
            if any(s in str(exc) for s in _CHANGED):
                raise TableChanged(f"table {table!r} changed underneath: {exc}") from exc
            raise

    def record_batch(self, writer_id: str, batch_id: int) -> bool:
        rows = self.execute(
            f"INSERT INTO {LEDGER} VALUES (?, ?, now()) ON CONFLICT DO NOTHING RETURNING batch_id",
            (writer_id, batch_id),
        )
        return len(rows) == 1

    def close(self) -> None:
        self.con.close()


# What DuckDB may hold in memory while it loads a batch (it spills beyond that); its default,
# 80% of the machine, let a 1M-row load take 750 MB where 256 MB loads as fast, and 160 MB
# about 5-8% slower for ~90 MB less (the load is the driver's peak).
MEMORY_LIMIT = "160MB"
APPLY_CHUNK_ROWS = 50_000  # a mirror's changes applied per statement (see _chunks)
# Each connection (``_connect``): rows are inserted by every thread at once (a batch's rows have
# no order that matters: the upsert's winner is chosen by _hw_order): measured 2.9 us a row
# instead of 5.9 on 2 cores. Closing the file does not checkpoint it
# (``disable_checkpoint_on_shutdown``): a bulk insert's row groups are already written and its
# commit is in the WAL, while a checkpoint at every close merged each batch's partly filled
# row groups with the table's (rewriting the whole batch: 1.3 s per 250k rows, twice the
# insert). DuckDB checkpoints by itself once the WAL passes its threshold; readers replay it.


class DuckDBDestination(ParquetStaging, SqlDestination):
    kind = "duckdb"
    release_after_use = True

    def __init__(
        self, path: Path, lock_timeout_s: float = 30.0, memory_limit: str = MEMORY_LIMIT
    ) -> None:
        super().__init__(DuckDBDialect(), LEDGER_SQL)
        self._lock = file_lock(path)
        self.path = path
        self.lock_timeout_s = lock_timeout_s
        self.memory_limit = memory_limit

    def _connect(self) -> Session:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                con = duckdb.connect(str(self.path))
                # set after connecting: a connection with another config could not share the
                # file with one this process opened otherwise (a poller, the console)
                con.execute("SET preserve_insertion_order = false")
                con.execute("PRAGMA disable_checkpoint_on_shutdown")
                con.execute(f"SET memory_limit = '{self.memory_limit}'")
                return DuckDBSession(con)
            except duckdb.IOException as exc:
                err = classify(exc)
                if not isinstance(err, DestinationUnavailable) or time.monotonic() > deadline:
                    raise err from exc
                time.sleep(0.05)  # another process holds the file: try again shortly

    def classify(self, exc: BaseException) -> HeadwaterError:
        return classify(exc)

    @property
    def staging(self) -> Path:
        return staging_beside(self.path)

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        groups = {table: staged_paths(ps) for table, ps in by_table(parts).items()}
        with self._using() as s:
            assert isinstance(s, DuckDBSession)
            keys = self._staged_keys(s, groups, schemas)

            def move() -> None:
                for table, paths in groups.items():
                    s.load_staged(table, paths, keys[table])

            done = commit_with_ledger(
                s, writer_id, batch_id, move, lambda: self._repatch(s, groups, schemas)
            )
        remove_files(parts)
        return done

    def apply_sql(self) -> ApplySql:
        from headwater.transport.apply import DuckDBApply

        return DuckDBApply()

    def _changes(self, s: Session, parts: Sequence[StagedPart]) -> str:
        # read where they are: a temporary table would hold them all in memory (OOM at the
        # destination's memory_limit on large batches), a Parquet scan streams
        files = ", ".join("'" + p.replace("'", "''") + "'" for p in staged_paths(parts))
        return f"read_parquet([{files}])"

    def _chunks(self, rows: int) -> int:
        # an upsert holds its rows in memory (ON CONFLICT): in parts of at most this many keys,
        # 200,000 changes of ~200 bytes apply within the default 160 MB
        return max(1, -(-rows // APPLY_CHUNK_ROWS))

    def _numbered(self, s: Session, parts: Sequence[StagedPart]) -> str:
        path = Path(staged_paths(parts)[0]).parent / f"numbered-{uuid.uuid4().hex}.parquet"
        s.execute(
            f"COPY (SELECT *, row_number() OVER (ORDER BY part, _hw_order) AS _hw_rn "
            f"FROM {self._changes(s, parts)}) TO '{path}' (FORMAT parquet)"
        )
        return f"read_parquet('{path}')"

    def _drop_changes(self, s: Session, relation: str) -> None:
        if relation.startswith("read_parquet('"):  # the numbered copy
            Path(relation.split("'")[1]).unlink(missing_ok=True)


def open_destination(config: DestinationConfig, data_dir: Path) -> DuckDBDestination:
    path = config.path or data_dir / "warehouse.duckdb"
    return DuckDBDestination(
        Path(path),
        float(config.options.get("lock_timeout_s", 30.0)),
        str(config.options.get("memory_limit", MEMORY_LIMIT)),
    )
