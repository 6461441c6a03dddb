"""The PostgreSQL CDC reader: a publication, a logical replication slot with ``pgoutput``, an
initial copy consistent with the slot, then the stream.

How it keeps every change exactly once in normal operation, at least once in recovery:
- **Copy.** A new slot exports its snapshot; every table is copied in it (``COPY`` in a
  repeatable-read transaction on that snapshot) before the stream starts, so the copy holds what
  committed before the slot's consistent point and the stream what committed after it. A table
  whose copy did not finish (a crash, or a table added later) is copied again in the snapshot of
  a temporary slot made for it; the stream then skips that table's transactions that committed
  before the copy's point. The state file records per table the point its copy is consistent
  with.
- **Acknowledge.** An LSN is flushed to the server only once the log holds every change up to it
  durably; a restart resumes from the slot's confirmed position, so changes appended but not yet
  acknowledged come again (in order: a mirror that upserts converges).
- **Quiet tables.** Every ``heartbeat_s`` without a message, the reader writes a logical message
  to the WAL; seeing it come back with nothing in flight, it acknowledges its LSN, so the slot
  does not hold WAL for other databases' or tables' traffic.
"""

from __future__ import annotations

import logging
import select
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwater.bus.base import Bus
from headwater.bus.records import Position
from headwater.transport.config import PostgresReaderConfig
from headwater.transport.message import Change, Mode, Op, now_ms
from headwater.transport.postgres import pgoutput
from headwater.transport.postgres.catalog import (
    SourceError,
    Table,
    TableColumn,
    Types,
    connect,
    database,
    ensure_publication,
    quote,
    resolve_tables,
    table,
)
from headwater.transport.postgres.values import Convert, copy_field
from headwater.transport.reader import Reader, wait_durable

log = logging.getLogger(__name__)
HEARTBEAT_PREFIX = "headwater-heartbeat"
_LAG_EVERY_S = 2.0
_COPY_LINES = 1 << 20


def lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_int(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass
class _Shape:
    """A captured table as the reader converts it: namespace, names, converters, key."""

    namespace: str
    topic: str
    names: tuple[str, ...]
    converters: tuple[Convert | None, ...]
    key: tuple[int, ...]
    columns: list[dict[str, Any]]
    schema: int

    def row(self, values: Sequence[Any]) -> tuple[dict[str, Any], list[str] | None]:
        """The row as a dict, and the columns left unchanged (absent from the dict)."""
        out: dict[str, Any] = {}
        unchanged: list[str] | None = None
        for name, convert, v in zip(self.names, self.converters, values, strict=True):
            if v is pgoutput.UNCHANGED:
                unchanged = [*(unchanged or ()), name]
            elif v is None or convert is None:
                out[name] = v
            else:
                out[name] = convert(v)
        return out, unchanged

    def key_of(self, values: Sequence[Any]) -> dict[str, Any] | None:
        if not self.key:
            return None
        out = {}
        for i in self.key:
            v = values[i]
            convert = self.converters[i]
            out[self.names[i]] = v if v is None or convert is None else convert(v)
        return out


def _schema_id(columns: list[dict[str, Any]]) -> int:
    text = "|".join(f"{c['name']}:{c['type']}:{int(c['key'])}" for c in columns)
    return zlib.crc32(text.encode())


class PostgresReader(Reader):
    config: PostgresReaderConfig

    def __init__(self, config: PostgresReaderConfig, bus: Bus, state_dir: Path) -> None:
        super().__init__(config, bus, state_dir)
        self._catalog: Any = None
        self._types: Types | None = None
        self._db = ""
        self._shapes: dict[int, _Shape] = {}  # by relation OID
        self._announced: dict[str, int] = {}  # namespace -> schema id sent this run
        self._copied_at: dict[str, int] = {}  # namespace -> LSN its copy is consistent with
        self._in_flight: deque[tuple[list[Future[Sequence[Position]]], int | None]] = deque()
        self._acked = 0
        self.changes = 0

    # -- run --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        cfg = self.config
        self._catalog = connect(cfg.dsn)
        try:
            self._types = Types(self._catalog)
            self._db = database(self._catalog)
            tables = resolve_tables(self._catalog, cfg.tables)
            if not tables:
                raise SourceError(f"no table of the source matches {cfg.tables!r}")
            ensure_publication(self._catalog, cfg.publication_name(), tables)
            state = self.load_state()
            self._copied_at = {k: lsn_int(v) for k, v in state.get("copied", {}).items()}
            for s, t in tables:
                ns = self._namespace(s, t)
                done = cfg.snapshot == "never" or ns in self._copied_at
                self.phase(ns, "sync" if done else "copy")
            repl = connect(cfg.dsn, replication=True)
            try:
                if not self._slot_exists():
                    self._create_slot(repl, tables, stop)
                missing = [st for st in tables if self._namespace(*st) not in self._copied_at]
                if missing and cfg.snapshot == "initial" and not stop.is_set():
                    self._copy_in_temporary_slot(missing, stop)
                if not stop.is_set():
                    self._stream(repl, stop)
            finally:
                repl.close()
        finally:
            self._catalog.close()
            self.report(force=True, running=False)

    def _namespace(self, schema: str, name: str) -> str:
        return f"{self._db}.{schema}.{name}"

    def _slot_exists(self) -> bool:
        with self._catalog.cursor() as cur:
            cur.execute(
                "select plugin, database from pg_replication_slots where slot_name = %s",
                (self.config.slot_name(),),
            )
            row = cur.fetchone()
        if row is not None and row[1] != self._db:
            raise SourceError(
                f"replication slot {self.config.slot_name()!r} belongs to database {row[1]!r}, "
                f"not {self._db!r}: name another slot"
            )
        if row is not None and row[0] != "pgoutput":
            raise SourceError(
                f"replication slot {self.config.slot_name()!r} exists with plugin {row[0]!r}, "
                "not pgoutput: drop it or name another slot"
            )
        return row is not None

    def _create_slot(self, repl: Any, tables: list[tuple[str, str]], stop: threading.Event) -> None:
        """Make the slot; with ``snapshot: initial`` copy every table in its snapshot first."""
        slot = self.config.slot_name()
        export = self.config.snapshot == "initial"
        with repl.cursor() as cur:
            how = "(SNAPSHOT 'export')" if export else "(SNAPSHOT 'nothing')"
            cur.execute(f"CREATE_REPLICATION_SLOT {quote(slot)} LOGICAL pgoutput {how}")
            _, point, snapshot, _ = cur.fetchone()
            log.info("reader %s: made slot %s at %s", self.config.id, slot, point)
            if export:
                self._copy(tables, snapshot, lsn_int(point), stop)
            else:
                self._copied_at = {self._namespace(*st): lsn_int(point) for st in tables}
                self._save()

    def _copy_in_temporary_slot(self, tables: list[tuple[str, str]], stop: threading.Event) -> None:
        """Copy ``tables`` in the snapshot of a temporary slot (dropped on disconnect)."""
        side = connect(self.config.dsn, replication=True)
        try:
            with side.cursor() as cur:
                name = f"{self.config.slot_name()}_copy"
                cur.execute(
                    f"CREATE_REPLICATION_SLOT {quote(name)} TEMPORARY LOGICAL pgoutput "
                    "(SNAPSHOT 'export')"
                )
                _, point, snapshot, _ = cur.fetchone()
                self._copy(tables, snapshot, lsn_int(point), stop)
        finally:
            side.close()

    # -- copy -------------------------------------------------------------------------------
    def _copy(
        self, tables: list[tuple[str, str]], snapshot: str, point: int, stop: threading.Event
    ) -> None:
        conn = connect(self.config.dsn)
        conn.autocommit = False
        try:
            with conn.cursor() as cur:
                cur.execute("begin isolation level repeatable read read only")
                cur.execute("set transaction snapshot %s", (snapshot,))
            for schema, name in tables:
                if stop.is_set():
                    return
                self._copy_table(conn, table(conn, schema, name), point, stop)
                if stop.is_set():
                    return
                namespace = self._namespace(schema, name)
                ts = now_ms()
                self.appender.add(Change(Op.COMPLETE, namespace, ts), Mode.COMPLETE)
                if not wait_durable(self.appender.send(), stop):
                    return
                self._copied_at[namespace] = point
                self._save()
                self.phase(namespace, "sync")
                self.report(force=True)
        finally:
            conn.rollback()
            conn.close()

    def _copy_table(self, conn: Any, t: Table, point: int, stop: threading.Event) -> None:
        shape = self._shape_of(t)
        self._announce(shape, Mode.COPY)
        limit = self.config.batch_records
        rows = 0
        reader = self
        position = lsn_text(point)  # a copied row is as of the copy's consistent point

        class Sink:
            buffer = b""

            def write(self, data: bytes) -> None:
                nonlocal rows
                lines = (self.buffer + data).split(b"\n")
                self.buffer = lines.pop()
                for line in lines:
                    reader._copy_row(shape, line.decode(), position)
                rows += len(lines)
                if reader.appender.count >= limit:
                    if not wait_durable(reader.appender.send(), stop) or stop.is_set():
                        raise _Stopped
                    reader.phase(shape.namespace, "copy", rows=rows)
                    reader.report()

        columns = ", ".join(quote(n) for n in shape.names)
        with conn.cursor() as cur:
            try:
                cur.copy_expert(f"copy (select {columns} from {t.qualified}) to stdout", Sink())
            except _Stopped:
                return
        wait_durable(self.appender.send(), stop)
        log.info("reader %s: copied %s rows of %s", self.config.id, rows, shape.namespace)
        self.phase(shape.namespace, "copy", rows=rows)

    def _copy_row(self, shape: _Shape, line: str, position: str) -> None:
        values = [copy_field(f) for f in line.split("\t")]
        data, _ = shape.row(values)
        ts = now_ms()
        change = Change(Op.READ, shape.namespace, ts, data, shape.key_of(values))
        change.schema = shape.schema
        change.position = position
        self.appender.add(change, Mode.COPY, shape.topic)

    # -- shapes -----------------------------------------------------------------------------
    def _shape_of(self, t: Table) -> _Shape:
        return self._shape(t.schema, t.name, t.columns)

    def _relation(self, rel: pgoutput.Relation) -> None:
        assert self._types is not None
        keys = [c.key for c in rel.columns]
        if rel.replica_identity == "f":  # every column is flagged: the key is the primary key
            primary = {
                c.name for c in table(self._catalog, rel.namespace, rel.name).columns if c.key
            }
            keys = [c.name in primary for c in rel.columns] if primary else keys
        columns = [
            TableColumn(c.name, c.type_oid, self._types.sql_type(c.type_oid, c.type_modifier), k)
            for c, k in zip(rel.columns, keys, strict=True)
        ]
        self._shapes[rel.oid] = self._shape(rel.namespace, rel.name, columns)

    def _shape(self, schema: str, name: str, columns: Sequence[TableColumn]) -> _Shape:
        """How a table's rows are converted (from the catalog for a copy, from a relation
        message for the stream)."""
        assert self._types is not None
        namespace = self._namespace(schema, name)
        described = [{"name": c.name, "type": c.sql_type, "key": c.key} for c in columns]
        return _Shape(
            namespace=namespace,
            topic=self.appender.topic(namespace, database=self._db, schema=schema, table=name),
            names=tuple(c.name for c in columns),
            converters=tuple(self._types.converter(c.type_oid) for c in columns),
            key=tuple(i for i, c in enumerate(columns) if c.key),
            columns=described,
            schema=_schema_id(described),
        )

    def _announce(self, shape: _Shape, mode: Mode, ts: int | None = None) -> None:
        """Send the namespace's schema before its first change, and again when it changes."""
        if self._announced.get(shape.namespace) == shape.schema:
            return
        ts = ts if ts is not None else now_ms()
        change = Change(Op.SCHEMA, shape.namespace, ts, schema=shape.schema, columns=shape.columns)
        self.appender.add(change, mode, shape.topic)
        self._announced[shape.namespace] = shape.schema

    # -- stream -----------------------------------------------------------------------------
    def _stream(self, repl: Any, stop: threading.Event) -> None:
        cfg = self.config
        cur = repl.cursor()
        options = {
            "proto_version": "1",
            "publication_names": cfg.publication_name(),
            "messages": "true",
        }
        cur.start_replication(slot_name=cfg.slot_name(), decode=False, options=options)
        log.info("reader %s: streaming from slot %s", cfg.id, cfg.slot_name())
        self.report(force=True, running=True, phase="sync")
        txn: _Txn = _Txn()
        linger_s = cfg.linger_ms / 1000
        first_pending = 0.0
        last_message = heartbeat_at = last_lag = time.monotonic()
        while not stop.is_set():
            msg = cur.read_message()
            now = time.monotonic()
            if msg is not None:
                last_message = now
                self._message(msg, txn)
                if self.appender.count and not first_pending:
                    first_pending = now
                if self.appender.count >= cfg.batch_records or (
                    first_pending and now - first_pending >= linger_s
                ):
                    self._send(txn.boundary)
                    first_pending = 0.0
                if self._in_flight and not self.appender.count & 255:
                    self._acknowledge(cur)
                continue
            if self.appender.count:  # nothing more to read now: append what is pending
                self._send(txn.boundary)
                first_pending = 0.0
            self._acknowledge(cur)
            if now - last_lag >= _LAG_EVERY_S:
                self._report_lag()
                last_lag = now
            if min(now - last_message, now - heartbeat_at) >= cfg.heartbeat_s:
                self._heartbeat()
                heartbeat_at = now
            timeout = 0.01 if self._in_flight else min(0.5, cfg.heartbeat_s)
            select.select([repl], [], [], timeout)
        self._drain(cur)

    def _message(self, msg: Any, txn: _Txn) -> None:
        """Handle one replication message."""
        m = pgoutput.decode(msg.payload)
        if isinstance(m, pgoutput.Begin):
            txn.begin(m)
        elif isinstance(m, pgoutput.Commit):
            txn.boundary = m.end_lsn
            self.changes += txn.count
            txn.count = 0
        elif isinstance(m, pgoutput.Relation):
            self._relation(m)
        elif isinstance(m, pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
            self._row_change(m, txn)
        elif isinstance(m, pgoutput.Truncate):
            for oid in m.relations:
                shape = self._shapes[oid]
                if self._skipped(shape, txn):
                    continue
                self._announce(shape, Mode.SYNC, txn.ts)
                change = Change(Op.TRUNCATE, shape.namespace, txn.ts, position=txn.position)
                self.appender.add(change, Mode.SYNC, shape.topic)
                txn.count += 1
        elif (
            isinstance(m, pgoutput.LogicalMessage)
            and m.prefix == HEARTBEAT_PREFIX
            and not m.transactional
            and not self._in_flight
            and not self.appender.count
        ):
            txn.boundary = max(txn.boundary, msg.data_start)
            self._in_flight.append(([], msg.data_start))

    def _skipped(self, shape: _Shape, txn: _Txn) -> bool:
        """A change the table's copy already holds (it committed before the copy's point)."""
        return txn.final_lsn < self._copied_at.get(shape.namespace, 0)

    def _row_change(
        self, m: pgoutput.Insert | pgoutput.Update | pgoutput.Delete, txn: _Txn
    ) -> None:
        shape = self._shapes[m.relation]
        if self._skipped(shape, txn):
            return
        self._announce(shape, Mode.SYNC, txn.ts)
        add = self.appender.add
        ts, position = txn.ts, txn.position
        if isinstance(m, pgoutput.Insert):
            data, _ = shape.row(m.new)
            change = Change(Op.INSERT, shape.namespace, ts, data, shape.key_of(m.new), None)
        elif isinstance(m, pgoutput.Update):
            data, unchanged = shape.row(m.new)
            key = shape.key_of(m.new)
            old = m.old or m.old_key
            before = shape.row(m.old)[0] if m.old is not None else None
            old_key = shape.key_of(old) if old is not None else key
            if old_key != key:  # the key changed: the old row goes, the new one comes
                gone = Change(Op.DELETE, shape.namespace, ts, None, old_key, before)
                gone.position = position
                add(gone, Mode.SYNC, shape.topic)
                txn.count += 1
            change = Change(Op.UPDATE, shape.namespace, ts, data, key, before, unchanged)
        else:
            old = m.old if m.old is not None else m.old_key
            before = shape.row(m.old)[0] if m.old is not None else None
            key = shape.key_of(old) if old is not None else None
            change = Change(Op.DELETE, shape.namespace, ts, None, key, before)
        change.position = position
        change.schema = shape.schema
        add(change, Mode.SYNC, shape.topic)
        txn.count += 1

    def _send(self, boundary: int) -> None:
        """Append what is pending; its LSN is acknowledged once durable (``boundary`` is the
        end of the last whole transaction in it, 0 in the middle of one)."""
        futures = self.appender.send()
        self._in_flight.append((futures, boundary or None))

    def _acknowledge(self, cur: Any, block: bool = False) -> None:
        while self._in_flight:
            futures, lsn = self._in_flight[0]
            if not block and not all(f.done() for f in futures):
                return
            for f in futures:
                f.result()  # an append that failed stops the reader before acknowledging
            self._in_flight.popleft()
            if lsn is not None and lsn > self._acked:
                cur.send_feedback(write_lsn=lsn, flush_lsn=lsn, apply_lsn=lsn, force=True)
                self._acked = lsn
                self.report(position=lsn_text(lsn), changes=self.changes)

    def _drain(self, cur: Any) -> None:
        """On stop: whole transactions still pending are appended and acknowledged."""
        self._acknowledge(cur, block=True)
        self.report(force=True, position=lsn_text(self._acked) if self._acked else None)

    def _heartbeat(self) -> None:
        with self._catalog.cursor() as cur:
            cur.execute("select pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,))

    def _report_lag(self) -> None:
        with self._catalog.cursor() as cur:
            cur.execute(
                "select pg_current_wal_lsn() - confirmed_flush_lsn, confirmed_flush_lsn "
                "from pg_replication_slots where slot_name = %s",
                (self.config.slot_name(),),
            )
            row = cur.fetchone()
        if row is not None:
            self.report(lag_bytes=int(row[0] or 0), confirmed=str(row[1]), changes=self.changes)

    def _save(self) -> None:
        self.save_state({"copied": {k: lsn_text(v) for k, v in self._copied_at.items()}})


class _Stopped(Exception):
    """Raised inside ``COPY`` to stop it when the reader is told to stop."""


class _Txn:
    """The transaction being received."""

    __slots__ = ("boundary", "count", "final_lsn", "position", "ts")

    def __init__(self) -> None:
        self.final_lsn = 0
        self.ts = 0
        self.position = ""
        self.boundary = 0  # end LSN of the last whole transaction received
        self.count = 0

    def begin(self, m: pgoutput.Begin) -> None:
        self.final_lsn = m.final_lsn
        self.ts = m.commit_us // 1000
        self.position = lsn_text(m.final_lsn)
