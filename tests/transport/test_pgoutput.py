"""pgoutput decoding against a real PostgreSQL (wal_level logical): the messages a slot sends
for inserts of every value kind, updates (with and without the old row, a TOASTed value left
unchanged), deletes, a truncate and a logical message decode to what was done; bad bytes fail
with a clear error."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from headwater.transport.postgres.pgoutput import (
    UNCHANGED,
    Begin,
    Commit,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Relation,
    Truncate,
    Update,
    decode,
)

pytestmark = pytest.mark.slow


def changes(dsn: str, statements: list[str], until: type) -> list[Any]:
    """The decoded messages a pgoutput slot sends for ``statements`` (run after the slot is
    made), up to the first message of type ``until`` after the last statement's commit."""
    import psycopg2
    import psycopg2.extras

    slot = f"probe_{time.monotonic_ns()}"
    rc = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cur = rc.cursor()
        cur.create_replication_slot(slot, output_plugin="pgoutput")
        with psycopg.connect(dsn, autocommit=True) as c:
            for statement in statements:
                c.execute(statement)
            c.execute("select pg_logical_emit_message(true, 'hw-end', 'done')")
        options = {"proto_version": "1", "publication_names": "probe", "messages": "true"}
        cur.start_replication(slot_name=slot, decode=False, options=options)
        out: list[Any] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = cur.read_message()
            if message is None:
                time.sleep(0.01)  # the stream's poll interval, bounded by the deadline
                continue
            decoded = decode(message.payload)
            out.append(decoded)
            if isinstance(decoded, LogicalMessage) and decoded.prefix == "hw-end":
                return out
        raise AssertionError(f"the slot did not send everything within 30 s: {out[-3:]}")
    finally:
        rc.close()
        drop_slot(dsn, slot)


def drop_slot(dsn: str, slot: str) -> None:
    """Drop ``slot`` once its sender has let go of it (it keeps WAL and a slot of the
    session's cluster otherwise)."""
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as c:
        while True:
            active = c.execute(
                "select active from pg_replication_slots where slot_name = %s", (slot,)
            ).fetchone()
            if active is None:
                return
            if not active[0]:
                c.execute("select pg_drop_replication_slot(%s)", (slot,))
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"replication slot {slot} still active after 30 s")
            time.sleep(0.05)  # the sender's exit, polled with a deadline


def test_every_kind_of_change_decodes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "create table kinds (id bigint primary key, n numeric, at timestamptz, doc jsonb,"
            " tags text[], raw bytea, u uuid, big text, note text)"
        )
        c.execute("alter table kinds alter column big set storage external")  # TOAST, no zip
        c.execute("create table whole (id int, v text)")
        c.execute("alter table whole replica identity full")
        c.execute("create publication probe for table kinds, whole")
    big = "x" * 10_000
    got = changes(
        dsn,
        [
            "insert into kinds values (1, 12345.678901234567890, '2026-11-25 12:00:00.5+00',"
            f" '{{\"a\": [1, null]}}', '{{a,\"b c\"}}', '\\x00ff', "
            f"'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{big}', 'first')",
            "insert into kinds (id) values (2)",
            "update kinds set note = 'second' where id = 1",  # big is TOASTed and untouched
            "update kinds set id = 3 where id = 2",  # the key changed: the old key is sent
            "delete from kinds where id = 3",
            "insert into whole values (1, 'a')",
            "update whole set v = 'b'",
            "delete from whole",
            "truncate kinds",
        ],
        LogicalMessage,
    )
    relations = {m.name: m for m in got if isinstance(m, Relation)}
    kinds = relations["kinds"]
    assert [c.name for c in kinds.columns][:3] == ["id", "n", "at"]
    assert [c.key for c in kinds.columns] == [True] + [False] * 8
    assert kinds.namespace == "public" and kinds.replica_identity == "d"
    assert relations["whole"].replica_identity == "f"
    begins, commits = (sum(isinstance(m, t) for m in got) for t in (Begin, Commit))
    assert begins == commits + 1 == 10  # one per statement; the last (the end mark) still open

    rows = [m for m in got if not isinstance(m, (Begin, Commit, Relation))]
    first, second, update, rekey, delete, *rest = rows
    assert isinstance(first, Insert) and first.relation == kinds.oid
    assert first.new == (
        "1",
        "12345.678901234567890",
        "2026-11-25 12:00:00.5+00",
        '{"a": [1, null]}',
        '{a,"b c"}',
        "\\x00ff",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        big,
        "first",
    )
    assert isinstance(second, Insert) and second.new == ("2", *[None] * 8)
    assert isinstance(update, Update) and update.old is None and update.old_key is None
    assert update.new[7] is UNCHANGED and update.new[8] == "second"  # never NULL
    assert isinstance(rekey, Update) and rekey.old_key is not None and rekey.old_key[0] == "2"
    assert isinstance(delete, Delete) and delete.old_key is not None
    assert delete.old_key[0] == "3" and delete.old_key[1:] == (None,) * 8
    insert_whole, update_whole, delete_whole, truncate, end = rest
    assert isinstance(insert_whole, Insert) and insert_whole.new == ("1", "a")
    assert isinstance(update_whole, Update) and update_whole.old == ("1", "a")
    assert update_whole.new == ("1", "b")
    assert isinstance(delete_whole, Delete) and delete_whole.old == ("1", "b")
    assert isinstance(truncate, Truncate) and truncate.relations == (kinds.oid,)
    assert not truncate.cascade and not truncate.restart_identity
    assert isinstance(end, LogicalMessage) and end.content == b"done" and end.transactional


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"Z", "unknown pgoutput message type 'Z'"),
        (b"B\x00\x00", "ends inside a field"),
        (b"I\x00\x00\x00\x01X", "expected 'N'"),
        (b"I\x00\x00\x00\x01N\x00\x01q", "unknown tuple value kind 'q'"),
        (b"I\x00\x00\x00\x01N\x00\x01t\x00\x00\x00\x09ab", "passes the message's end"),
        (b"R\x00\x00\x00\x01public", "has no end"),
    ],
)
def test_bad_bytes_fail_clearly(data: bytes, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode(data)
