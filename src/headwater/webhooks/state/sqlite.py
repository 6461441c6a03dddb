"""The embedded webhook state: SQLite in WAL mode in one file under ``data_dir`` (several
processes on one machine may share it: writes take the database's lock). Each step that
changes a message is one statement (``UPDATE ... WHERE <the status it may come from> RETURNING``),
atomic by itself; the few that read, then write run in a transaction (or a savepoint).

Grouped changes (``batch_on``): the webhook workers' event loop makes many small changes, and a
transaction of its own costs each of them about twice what the change does (measured: 253 ->
154 us per message for a message's six statements, in transactions of 16 messages). On the
loop's thread the changes then go into one transaction per turn of the loop, committed at the
start of the next turn; ``flush`` waits for that commit, and the workers wait on it before
anything the change must precede is seen outside (a request sent, a record appended, an offset
committed). A change made on another thread commits at once, with the loop's open ones.

A group holds the database's write lock for the rest of its turn, which under load is most of
the time: another process writing the same file (several ``headwater webhooks`` on one
machine) would rarely get in. So once another connection is seen to have committed (``PRAGMA
data_version``), each change commits alone again, as before, until nobody else wrote for
``SHARED_S``.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import orjson

from headwater.webhooks.state.base import (
    Attempt,
    Attempts,
    Claim,
    Cursor,
    InvalidTransition,
    MessageState,
    ReceiverState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
    Via,
    attempts_of,
    path_to,
    stamped,
    statuses,
)

log = logging.getLogger(__name__)
BUSY_TIMEOUT_S = 30.0
SET_UP_RETRY_S = 0.01
SHARED_S = 10.0  # no groups for this long after another connection was seen writing
CHECKPOINT_EVERY_S = 1.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    source_id TEXT NOT NULL, message_id TEXT NOT NULL, receiver TEXT NOT NULL,
    status TEXT NOT NULL, payload BLOB NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, reason TEXT NOT NULL DEFAULT '', response BLOB,
    history TEXT NOT NULL, attempts TEXT NOT NULL DEFAULT '[]', sending_until REAL,
    was_sending REAL,
    PRIMARY KEY (source_id, message_id)
);
DROP INDEX IF EXISTS messages_status;
DROP INDEX IF EXISTS messages_failed;
DROP INDEX IF EXISTS messages_done;
CREATE INDEX IF NOT EXISTS messages_by_status
    ON messages (status, updated_at, source_id, message_id);
DROP INDEX IF EXISTS messages_by_receiver;
DROP INDEX IF EXISTS messages_by_source;
DROP INDEX IF EXISTS messages_by_source_receiver;
CREATE TABLE IF NOT EXISTS schedule (
    kind TEXT NOT NULL, source_id TEXT NOT NULL, message_id TEXT NOT NULL, due_at REAL NOT NULL,
    PRIMARY KEY (kind, source_id, message_id)
);
CREATE INDEX IF NOT EXISTS schedule_due ON schedule (kind, due_at);
CREATE TABLE IF NOT EXISTS rates (receiver TEXT PRIMARY KEY, tat REAL NOT NULL);
CREATE TABLE IF NOT EXISTS receivers (
    name TEXT PRIMARY KEY, disabled INTEGER NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL
);
"""
# the listing's one index (by status, newest last; FAILED's and DONE's ranges also serve
# ``failed`` and ``purge``): a page of ``messages`` is one range per status. A source or a
# receiver is filtered while walking the range, not indexed: every index costs each status
# change a write (four of them made ``advance`` 2.5 times slower); a rare source's page may
# walk more of the range, a few ms at 100k messages.
_NEWEST = "ORDER BY updated_at DESC, source_id DESC, message_id DESC"
_COLUMNS = (
    "receiver, status, payload, created_at, updated_at, reason, response, history, attempts, "
    "source_id, message_id"
)


class SqliteState(StateStore):
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # whose changes are grouped
        self._loop_thread = 0
        self._open = False  # a transaction of grouped changes is open
        self._waiting: list[asyncio.Future[None]] = []  # ``flush``es of the open transaction
        self._lost: sqlite3.Error | None = None  # a group's commit failed: it is gone
        self._version: int | None = None  # PRAGMA data_version at the last look
        self._shared_until = 0.0  # another connection wrote lately: no groups until then
        self._closed = threading.Event()
        self._checkpointer = threading.Thread(
            target=self._checkpoint, name="webhooks-state-checkpoint", daemon=True
        )
        try:
            self._set_up()
        except BaseException:
            self._conn.close()
            raise
        self._checkpointer.start()

    def _set_up(self) -> None:
        """WAL mode and the schema. Processes that open a new file at once (the intake
        workers of ``headwater up``) may find it locked while one of them switches it to WAL,
        which SQLite reports at once instead of waiting: they try again until the busy
        timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if e.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
                time.sleep(SET_UP_RETRY_S)
        self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at each checkpoint
        # checkpoints (copying the WAL back, with an fsync) run on a thread of their own, not
        # inside whichever commit crosses the WAL's size
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(messages)")}
        for column in ("sending_until", "was_sending"):  # a file from before these columns
            if columns and column not in columns:
                self._conn.execute(f"ALTER TABLE messages ADD COLUMN {column} REAL")
        for statement in filter(str.strip, _SCHEMA.split(";")):
            self._conn.execute(statement)

    def _checkpoint(self) -> None:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            while not self._closed.wait(CHECKPOINT_EVERY_S):
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()

    # -- grouped changes ---------------------------------------------------------------------
    def batch_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Group the changes made on ``loop``'s thread (call it there) into one transaction
        per turn of the loop; None: each change commits alone again (the open group first)."""
        with self._lock:
            self._commit_group()
            self._loop = loop
            self._loop_thread = threading.get_ident() if loop is not None else 0

    async def flush(self) -> None:
        """Wait until every change made so far is committed. Once a group's commit failed,
        every flush raises that error: what followed the lost changes must not be taken as
        done (the workers stop, and read their uncommitted records again when restarted)."""
        if self._lost is not None:
            raise self._lost
        if not self._open:
            return
        waiter = asyncio.get_running_loop().create_future()
        with self._lock:  # (another thread may commit the group meanwhile: then nothing waits)
            if not self._open:
                return
            self._waiting.append(waiter)
        await waiter

    def _grouping(self) -> bool:
        """Whether a change made now joins the loop's group: on the loop's thread, unless
        another connection (another worker process) wrote lately (under ``_lock``)."""
        if self._loop is None or threading.get_ident() != self._loop_thread:
            return False
        if self._shared_until and time.monotonic() > self._shared_until:
            # shared lately: group again once nobody else wrote for SHARED_S
            self._shared_until = time.monotonic() + SHARED_S if self._others_wrote() else 0.0
        return not self._shared_until

    def _others_wrote(self) -> bool:
        """Whether another connection committed since the last look (``data_version`` moves
        with every commit but this connection's)."""
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        seen, self._version = self._version, version
        return seen is not None and version != seen

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """Where a change runs: in the loop's open group (opened here, committed at the next
        turn), or alone (committing with it any group open on the loop's thread)."""
        with self._lock:
            if self._grouping():
                if not self._open:
                    self._conn.execute("BEGIN IMMEDIATE")
                    self._open = True
                    self._loop.call_soon(self._end_turn)  # type: ignore[union-attr]
                yield self._conn
                return
            yield self._conn
            self._commit_group()

    def _end_turn(self) -> None:
        with self._lock:
            self._commit_group()

    def _commit_group(self) -> None:
        """Commit the open group (under ``_lock``) and wake its ``flush``es."""
        if not self._open:
            return
        self._open = False
        waiting, self._waiting = self._waiting, []
        error: BaseException | None = None
        try:
            self._conn.execute("COMMIT")
            if self._others_wrote():  # another process writes too: leave it room
                if not self._shared_until:
                    log.info("webhooks state: another process writes %s too", self.path)
                self._shared_until = time.monotonic() + SHARED_S
        except sqlite3.Error as e:  # nothing of the group is kept: every flush from now fails
            error = self._lost = e
            log.error("webhooks state: a group of changes could not be committed: %s", e)
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
        if waiting:
            loop = self._loop
            assert loop is not None
            if threading.get_ident() == self._loop_thread:
                _wake(waiting, error)
            else:
                with suppress(RuntimeError):  # the loop closed: nothing waits anymore
                    loop.call_soon_threadsafe(_wake, waiting, error)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A read-then-write step, atomic: its own transaction, or a savepoint in the group."""
        with self._write() as c:
            grouped = self._open
            c.execute("SAVEPOINT step" if grouped else "BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                c.execute("ROLLBACK TO step" if grouped else "ROLLBACK")
                if grouped:
                    c.execute("RELEASE step")
                raise
            c.execute("RELEASE step" if grouped else "COMMIT")

    def arrive(
        self, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> tuple[bool, MessageState]:
        return self.arrive_many([(source_id, message_id, receiver, payload)], now)[0]

    def arrive_many(
        self,
        messages: list[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[tuple[bool, MessageState]]:
        history = _json([[Status.ARRIVED.value, now, ""]])
        arrived = Status.ARRIVED.value
        out: list[tuple[bool, MessageState]] = []
        with self._tx() as c:
            for (source_id, message_id, receiver, payload), claim in zip(
                messages, claims or [None] * len(messages), strict=True
            ):
                inserted = c.execute(
                    "INSERT OR IGNORE INTO messages (source_id, message_id, receiver, status, "
                    "payload, created_at, updated_at, history, sending_until) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (source_id, message_id, receiver, arrived, payload, now, now, history, claim),
                ).rowcount
                if inserted:
                    state = MessageState.arrived(source_id, message_id, receiver, payload, now)
                    out.append((True, state))
                else:
                    existing = self._read(c, source_id, message_id)
                    assert existing is not None
                    out.append((False, existing))
        return out

    def known(self, source_id: str, message_id: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM messages WHERE source_id = ? AND message_id = ?",
                (source_id, message_id),
            ).fetchone()
        return row is not None

    def get(self, source_id: str, message_id: str) -> MessageState | None:
        with self._lock:
            return self._read(self._conn, source_id, message_id)

    def advance(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Status | None = None,
        retry: bool = False,
        attempt: Attempt | None = None,
    ) -> MessageState:
        """One statement: the transition(s) appended, the attempt too, only from an allowed
        status; the row as it is now returned."""
        row = self._advance(
            source_id, message_id, status, now, reason, response, via, retry, attempt, _COLUMNS
        )
        return _state(row)

    def move(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        """``advance`` without reading the row back."""
        self._advance(*state.key, status, now, reason, response, via, False, attempt, "1", via_at)
        return state.moved(
            status, now, reason=reason, response=response, via=via, via_at=via_at, attempt=attempt
        )

    def _advance(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        reason: str,
        response: bytes | None,
        via: Via,
        retry: bool,
        attempt: Attempts,
        returning: str,
        via_at: float | None = None,
    ) -> tuple[Any, ...]:
        tried = attempts_of(attempt)
        shape = (status, via, retry, len(tried), returning)
        statement = _STATEMENTS.get(shape)
        if statement is None:
            statement = _STATEMENTS[shape] = _advance_statement(*shape)
        sql, allowed = statement
        args: list[object] = [
            status.value,
            now,
            reason if status is Status.FAILED else "",
            response,
        ]
        args += [_json([step.value, at, reason]) for step, at in stamped(status, via, now, via_at)]
        args += [_json(a) for a in tried]
        args += [source_id, message_id, *allowed]
        with self._write() as c:
            # fetchall: the statement runs to its end (alone: its transaction commits now)
            rows = c.execute(sql, args).fetchall()
            if rows:
                return tuple(rows[0])
            current = self._read(c, source_id, message_id)
        if current is None:
            raise UnknownMessage(f"no message {source_id}/{message_id}")
        raise InvalidTransition(current.key, current.status, status)

    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        entry = _json(attempt)
        with self._write() as c:
            changed = c.execute(
                "UPDATE messages SET attempts = json_insert(attempts, '$[#]', json(?)), "
                "sending_until = NULL WHERE source_id = ? AND message_id = ?",
                (entry, source_id, message_id),
            ).rowcount
        if not changed:
            raise UnknownMessage(f"no message {source_id}/{message_id}")

    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        with self._write() as c:
            c.execute(
                "INSERT INTO schedule (kind, source_id, message_id, due_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (kind, source_id, message_id) DO UPDATE SET due_at = excluded.due_at",
                (kind, source_id, message_id, due_at),
            )

    def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        with self._tx() as c:
            rows = c.execute(
                "SELECT source_id, message_id FROM schedule WHERE kind = ? AND due_at <= ? "
                "ORDER BY due_at LIMIT ?",
                (kind, now, limit),
            ).fetchall()
            keys = [(kind, s, m) for s, m in rows]
            if lease_s:
                c.executemany(
                    "UPDATE schedule SET due_at = ? "
                    "WHERE kind = ? AND source_id = ? AND message_id = ?",
                    [(now + lease_s, *k) for k in keys],
                )
            else:
                c.executemany(
                    "DELETE FROM schedule WHERE kind = ? AND source_id = ? AND message_id = ?",
                    keys,
                )
        return [(str(s), str(m)) for s, m in rows]

    def release(self, kind: str, source_id: str, message_id: str, leased_until: float) -> None:
        with self._write() as c:
            c.execute(
                "DELETE FROM schedule WHERE kind = ? AND source_id = ? AND message_id = ? "
                "AND due_at = ?",
                (kind, source_id, message_id, leased_until),
            )

    def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        with self._write() as c:
            rows = c.execute(
                "UPDATE messages SET was_sending = sending_until, sending_until = ? "
                "WHERE source_id = ? AND message_id = ? AND status = ? "
                "AND json_array_length(attempts) = ? "
                "AND (sending_until IS NULL OR sending_until <= ?) RETURNING was_sending",
                (until, *state.key, state.status.value, len(state.attempts), now),
            ).fetchall()  # to its end (alone: its transaction commits now)
            if rows:
                return Claim.CLAIMED if rows[0][0] is None else Claim.INTERRUPTED
            found = c.execute(
                "SELECT status, json_array_length(attempts) FROM messages "
                "WHERE source_id = ? AND message_id = ?",
                state.key,
            ).fetchone()
        if found is None:
            raise UnknownMessage(f"no message {state.source_id}/{state.message_id}")
        if found[0] != state.status.value or found[1] != len(state.attempts):
            return Claim.MOVED
        return Claim.BUSY

    def failed(
        self, receiver: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[MessageState]:
        # messages_by_status answers this (the receiver filtered while walking its range)
        sql = f"SELECT {_COLUMNS} FROM messages WHERE status = 'FAILED' AND updated_at >= ?"
        args: list[object] = [since or 0.0]
        if receiver is not None:
            sql += " AND receiver = ?"
            args.append(receiver)
        with self._lock:
            rows = self._conn.execute(f"{sql} ORDER BY updated_at LIMIT ?", (*args, limit))
            return [_state(row) for row in rows.fetchall()]

    def messages(
        self,
        source_id: str | None,
        status: str | None,
        receiver: str | None,
        limit: int,
        before: Cursor | None = None,
    ) -> list[MessageState]:
        """One range of an index per status selected (the newest ``limit`` after the cursor),
        merged; then the rows of those kept."""
        selected = statuses(status)
        if limit <= 0:
            return []
        where: list[str] = []
        args: list[object] = []
        if source_id is not None:
            where.append("source_id = ?")
            args.append(source_id)
        if receiver is not None:
            where.append("receiver = ?")
            args.append(receiver)
        if before is not None:  # the index's columns after its equalities: a range
            where.append("(updated_at, source_id, message_id) < (?, ?, ?)")
            args += list(before)
        ranges: list[str] = []
        range_args: list[object] = []
        for wanted in selected:
            ranges.append(
                "SELECT * FROM (SELECT rowid AS id, updated_at, source_id, message_id "
                f"FROM messages WHERE {' AND '.join(['status = ?', *where])} {_NEWEST} LIMIT ?)"
            )
            range_args += [wanted.value, *args, limit]
        sql = (
            f"SELECT {_COLUMNS} FROM messages WHERE rowid IN (SELECT id FROM "
            f"({' UNION ALL '.join(ranges)}) {_NEWEST} LIMIT ?) {_NEWEST}"
        )
        with self._lock:
            rows = self._conn.execute(sql, (*range_args, limit)).fetchall()
        return [_state(row) for row in rows]

    def counts(self, receiver: str | None = None) -> dict[str, dict[str, int]]:
        sql = "SELECT receiver, status, count(*) FROM messages"  # a scan: ~20 ms at 100k
        args: tuple[str, ...] = ()
        if receiver is not None:
            sql += " WHERE receiver = ?"
            args = (receiver,)
        with self._lock:
            rows = self._conn.execute(f"{sql} GROUP BY receiver, status", args).fetchall()
        out: dict[str, dict[str, int]] = {}
        for name, status, n in rows:
            out.setdefault(name, {s.value: 0 for s in Status})[status] = n
        return out

    def purge(self, before: float, limit: int = 1000) -> int:
        with self._write() as c:
            return c.execute(
                "DELETE FROM messages WHERE rowid IN (SELECT rowid FROM messages "
                "WHERE status = 'DONE' AND updated_at < ? LIMIT ?)",
                (before, limit),
            ).rowcount

    def set_receiver(self, name: str, disabled: bool, reason: str, now: float) -> None:
        with self._write() as c:
            c.execute(
                "INSERT INTO receivers (name, disabled, reason, at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET disabled = excluded.disabled, "
                "reason = excluded.reason, at = excluded.at",
                (name, int(disabled), reason, now),
            )

    def receivers(self) -> dict[str, ReceiverState]:
        with self._lock:
            rows = self._conn.execute("SELECT name, disabled, reason, at FROM receivers")
            return {n: ReceiverState(n, bool(d), r, at) for n, d, r, at in rows.fetchall()}

    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        interval = per_s / requests
        with self._tx() as c:
            now = time.time()
            row = c.execute("SELECT tat FROM rates WHERE receiver = ?", (receiver,)).fetchone()
            tat = float(row[0]) if row else now
            if tat < now - interval:  # (late by less: counted from when it was due)
                tat = now
            if tat > now:
                return tat - now
            c.execute(
                "INSERT INTO rates (receiver, tat) VALUES (?, ?) "
                "ON CONFLICT (receiver) DO UPDATE SET tat = excluded.tat",
                (receiver, tat + interval),
            )
        return 0.0

    def close(self) -> None:
        self.batch_on(None)
        self._closed.set()
        self._checkpointer.join()
        with self._lock:
            self._conn.close()

    @staticmethod
    def _read(c: sqlite3.Connection, source_id: str, message_id: str) -> MessageState | None:
        row = c.execute(
            f"SELECT {_COLUMNS} FROM messages WHERE source_id = ? AND message_id = ?",
            (source_id, message_id),
        ).fetchone()
        return None if row is None else _state(row)


_STATUS = {s.value: s for s in Status}
# the UPDATE of a move by its shape (see ``_advance_statement``), made once
_STATEMENTS: dict[tuple[Any, ...], tuple[str, list[str]]] = {}


def _advance_statement(
    status: Status, via: Via, retry: bool, attempts: int, returning: str
) -> tuple[str, list[str]]:
    """The UPDATE of a move to ``status`` (through ``via``; a ``retry``) recording
    ``attempts`` attempts, and the statuses it may come from. Its parameters: the status, the
    time, the reason, the response, the history entries (``stamped``), the attempts, the
    message's key, the statuses it may come from."""
    allowed, steps = path_to(status, via, retry)
    entries = ", ".join(["'$[#]', json(?)"] * len(steps))
    sql = (
        "UPDATE messages SET status = ?, updated_at = ?, reason = ?, "
        f"response = COALESCE(?, response), history = json_insert(history, {entries})"
    )
    if attempts:
        pairs = ", ".join(["'$[#]', json(?)"] * attempts)
        sql += f", attempts = json_insert(attempts, {pairs})"
        sql += ", sending_until = NULL"  # (an attempt recorded: its send is over)
    marks = ", ".join("?" * len(allowed))
    sql += f" WHERE source_id = ? AND message_id = ? AND status IN ({marks}) RETURNING {returning}"
    return sql, sorted(a.value for a in allowed)


def _json(value: object) -> str:
    """JSON text for SQLite's json functions (text: a blob would not be JSON to them)."""
    return orjson.dumps(value).decode()


def _wake(waiting: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for waiter in waiting:
        if waiter.done():
            continue
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)


def _state(row: tuple[Any, ...]) -> MessageState:
    (receiver, status, payload, created, updated, reason, response, history, attempts) = row[:9]
    source_id, message_id = row[9:]
    return MessageState(
        source_id=source_id,
        message_id=message_id,
        receiver=receiver,
        status=_STATUS[status],
        payload=bytes(payload),
        created_at=created,
        updated_at=updated,
        reason=reason,
        response=bytes(response) if response is not None else None,
        history=tuple(Transition(_STATUS[s], at, r) for s, at, r in orjson.loads(history)),
        attempts=tuple(Attempt(**a) for a in orjson.loads(attempts)),
    )
