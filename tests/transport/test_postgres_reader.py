"""The PostgreSQL CDC reader against a real PostgreSQL (wal_level logical) and the embedded log:
the copy is consistent with the slot (rows inserted during it appear exactly once), every value
kind round-trips, updates/deletes/truncates and unchanged TOAST values come as the seed's
messages, the schema follows ALTER TABLE, a restart resumes without a duplicate, a table whose
copy did not finish is copied again consistently, and heartbeats move a quiet slot."""

from __future__ import annotations

import base64
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from tests.transport.pg_source import (
    execute,
    messages,
    reader_config,
    running,
    slot_confirmed,
    wait_until,
)

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.transport.message import Mode, Op, decode
from headwater.transport.reader import read_json, read_status

pytestmark = pytest.mark.slow

TYPES_TABLE = """
create table kinds (
    id bigint primary key, n numeric(12, 2), big numeric, ts timestamptz, d date,
    j jsonb, ints int[], texts text[], b bytea, u uuid, f float8, ok boolean, note text
)"""


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    b = EmbeddedBus(tmp_path / "log")
    yield b
    b.close()


def copied(bus: EmbeddedBus, tables: int = 1) -> None:
    """Wait until ``tables`` copies are complete, so that what follows is streamed."""
    wait_until(
        f"{tables} copies", lambda: sum(c.op == Op.COMPLETE for c, _ in messages(bus)) >= tables
    )


def rows(bus: EmbeddedBus, op: Op | None = None) -> list[dict]:
    return [c.data for c, _ in messages(bus) if (op is None or c.op == op) and c.data]


def test_copy_is_consistent_with_the_stream(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(dsn, "create table t (id bigint primary key, v text)")
    execute(dsn, "insert into t select g, 'row ' || g from generate_series(1, 20000) g")
    stop = threading.Event()
    inserted: list[int] = []

    def insert() -> None:  # inserts while the slot is made and the copy runs
        i = 20001
        with psycopg.connect(dsn, autocommit=True) as c:
            while not stop.is_set():
                c.execute(f"insert into t values ({i}, 'late')")
                inserted.append(i)
                i += 1

    writer = threading.Thread(target=insert, daemon=True)
    writer.start()
    with running(reader_config(dsn, batch_records=1000), bus, tmp_path / "state") as reader:
        wait_until("the copy", lambda: reader.state_path.exists())
        stop.set()
        writer.join(10)
        expected = set(range(1, 20001)) | set(inserted)
        wait_until(
            "every row once",
            lambda: {r["id"] for r in rows(bus)} >= expected,
        )
    ids = Counter(r["id"] for r in rows(bus))
    assert set(ids) == expected and max(ids.values()) == 1
    got = messages(bus)
    modes = Counter(m for _, m in got)
    assert modes[Mode.COPY] >= 20000 + 1 and modes[Mode.COMPLETE] == 1
    complete = next(i for i, (c, _) in enumerate(got) if c.op == Op.COMPLETE)
    assert all(c.op == Op.READ for c, _ in got[1:complete])  # the schema, the copy, complete
    assert got[0][0].op == Op.SCHEMA
    assert {c.op for c, _ in got[complete + 1 :]} <= {Op.INSERT, Op.SCHEMA}
    assert len(inserted) > 0


def test_values_round_trip(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(dsn, TYPES_TABLE)
    values = """(1, 12.50, 123456789012345678901234567890.123456789,
        '2024-02-29 23:59:59.123456+05', '2024-01-01', '{"a": [1, 2.50, null], "b": "x\\ty"}',
        '{1,NULL,3}',
        '{"a b","c,d","e\\"f",NULL}', '\\xdeadbeef00', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
        'NaN', true, E'tab\\there\\nline \\\\ back')"""
    nulls = "(2, null, null, null, null, null, null, null, null, null, null, null, null)"
    execute(dsn, f"insert into kinds values {values}, {nulls}")  # copied
    with running(reader_config(dsn), bus, tmp_path / "state"):
        wait_until("the copy", lambda: len(rows(bus, Op.READ)) == 2)
        execute(dsn, f"insert into kinds values {values.replace('(1,', '(3,', 1)}")
        wait_until("the insert", lambda: rows(bus, Op.INSERT))
    copied = {r["id"]: r for r in rows(bus, Op.READ)}
    streamed = rows(bus, Op.INSERT)[0]
    for row in (copied[1], streamed):
        assert row["n"] == "12.50"
        assert row["big"] == "123456789012345678901234567890.123456789"
        assert row["ts"] == "2024-02-29 18:59:59.123456+00"
        assert row["d"] == "2024-01-01"
        assert row["j"] == '{"a": [1, 2.50, null], "b": "x\\ty"}'
        assert row["ints"] == [1, None, 3]
        assert row["texts"] == ["a b", "c,d", 'e"f', None]
        assert base64.b64decode(row["b"]) == bytes.fromhex("deadbeef00")
        assert row["u"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
        assert row["f"] == "NaN" and row["ok"] is True
        assert row["note"] == "tab\there\nline \\ back"
    assert set(copied[2].values()) == {2, None}
    schema = next(c for c, _ in messages(bus) if c.op == Op.SCHEMA)
    types = {c["name"]: c["type"] for c in schema.columns or []}
    assert types["n"] == "numeric(12,2)" and types["ts"] == "timestamp with time zone"
    assert types["ints"] == "integer[]" and [c["key"] for c in schema.columns or []][:2] == [
        True,
        False,
    ]


def test_updates_deletes_truncate_toast(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(
        dsn,
        "create table t (id int primary key, small text, large text)",
        "create table full_t (id int primary key, v text)",
        "alter table full_t replica identity full",
        "alter table t alter column large set storage external",  # TOASTed, uncompressed
    )
    large = "x" * 100_000
    with running(reader_config(dsn), bus, tmp_path / "state"):
        wait_until(
            "the copy", lambda: len([c for c, _ in messages(bus) if c.op == Op.COMPLETE]) == 2
        )
        execute(
            dsn,
            f"insert into t values (1, 'a', '{large}'), (2, 'b', 'short')",
            "insert into full_t values (1, 'one')",
            "update t set small = 'a2' where id = 1",  # large is left unchanged
            "update t set id = 20 where id = 2",  # the key changes
            "update full_t set v = 'uno' where id = 1",
            "delete from t where id = 20",
            "delete from full_t where id = 1",
            "truncate t",
        )
        wait_until("the truncate", lambda: any(c.op == Op.TRUNCATE for c, _ in messages(bus)))
    changes = [c for c, _ in messages(bus) if c.op not in (Op.SCHEMA, Op.COMPLETE)]
    by_ns = {ns: [c for c in changes if c.namespace.endswith(ns)] for ns in (".t", ".full_t")}
    t = by_ns[".t"]
    assert [(c.op, c.key) for c in t] == [
        (Op.INSERT, {"id": 1}),
        (Op.INSERT, {"id": 2}),
        (Op.UPDATE, {"id": 1}),
        (Op.DELETE, {"id": 2}),
        (Op.UPDATE, {"id": 20}),
        (Op.DELETE, {"id": 20}),
        (Op.TRUNCATE, None),
    ]
    toast = t[2]
    assert toast.data == {"id": 1, "small": "a2"} and toast.unchanged == ["large"]
    assert t[0].data is not None and t[0].data["large"] == large
    full = by_ns[".full_t"]
    assert full[1].op == Op.UPDATE and full[1].before == {"id": 1, "v": "one"}
    assert full[2].op == Op.DELETE and full[2].before == {"id": 1, "v": "uno"}
    assert all(c.position and c.ts_ms > 0 for c in changes)


def test_alter_table_changes_the_schema(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(dsn, "create table t (id int primary key, v text)")
    with running(reader_config(dsn), bus, tmp_path / "state"):
        copied(bus)
        execute(dsn, "insert into t values (1, 'a')")
        wait_until("the insert", lambda: rows(bus, Op.INSERT))
        execute(
            dsn, "alter table t add column extra numeric(5,1)", "insert into t values (2, 'b', 1.5)"
        )
        wait_until("the second insert", lambda: len(rows(bus, Op.INSERT)) == 2)
    got = [c for c, _ in messages(bus)]
    schemas = [c for c in got if c.op == Op.SCHEMA]
    assert [len(s.columns or []) for s in schemas] == [2, 3]
    assert schemas[1].columns[-1] == {"name": "extra", "type": "numeric(5,1)", "key": False}
    second = got.index(schemas[1])
    assert got[second + 1].data == {"id": 2, "v": "b", "extra": "1.5"}


def test_restart_resumes_without_duplicates(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(
        dsn, "create table t (id int primary key)", "insert into t select generate_series(1, 100)"
    )
    config = reader_config(dsn)
    state = tmp_path / "state"
    with running(config, bus, state):
        execute(dsn, "insert into t select generate_series(101, 200)")
        wait_until("200 rows", lambda: len(rows(bus)) == 200)
        lsn = wait_until("an acknowledged LSN", lambda: slot_confirmed(dsn, config.slot_name()))
    reads = len(rows(bus, Op.READ))
    execute(dsn, "insert into t select generate_series(201, 300)")  # while the reader is down
    with running(config, bus, state):
        wait_until("300 rows", lambda: len(rows(bus)) >= 300)
        execute(dsn, "insert into t values (301)")
        wait_until("301 rows", lambda: len(rows(bus)) >= 301)
    ids = Counter(r["id"] for r in rows(bus))
    assert set(ids) == set(range(1, 302)) and max(ids.values()) == 1
    assert len(rows(bus, Op.READ)) == reads  # not copied again
    assert slot_confirmed(dsn, config.slot_name()) > lsn
    status = read_status(state)
    assert status["namespaces"][f"{dsn.rsplit('/', 1)[1]}.public.t"]["phase"] == "sync"


def test_an_unfinished_copy_is_done_again(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(
        dsn,
        "create table a (id int primary key)",
        "create table b (id int primary key)",
        "insert into a select generate_series(1, 10)",
        "insert into b select generate_series(1, 10)",
    )
    config = reader_config(dsn)
    state = tmp_path / "state"
    with running(config, bus, state):
        wait_until("both copies", lambda: len(rows(bus, Op.READ)) == 20)
    # As if the reader died while copying b: its copy is not recorded.
    body = read_json(state / "state.json")
    db = dsn.rsplit("/", 1)[1]
    del body["copied"][f"{db}.public.b"]
    from headwater.transport.reader import write_json

    write_json(state / "state.json", body)
    execute(
        dsn, "insert into b values (11)", "insert into a values (11)", "delete from b where id = 1"
    )
    with running(config, bus, state):
        copied(bus, 2 + 1)
        execute(dsn, "insert into b values (12)")
        wait_until(
            "b's insert after the copy", lambda: {12} <= {r["id"] for r in rows(bus, Op.INSERT)}
        )
    b = [c for c, _ in messages(bus) if c.namespace.endswith(".b")]
    second_copy = {c.data["id"] for c in b if c.op == Op.READ} - set(range(1, 11))
    recopied = [c.data["id"] for c in b if c.op == Op.READ][10:]
    assert sorted(recopied) == list(range(2, 12)) and not second_copy - {11}
    streamed_b = [(c.op, (c.key or {}).get("id")) for c in b if c.op in (Op.INSERT, Op.DELETE)]
    assert streamed_b == [(Op.INSERT, 12)]  # 11 and the delete are in the new copy
    a_inserts = [c.data["id"] for c in messages_of(bus, ".a") if c.op == Op.INSERT]
    assert a_inserts == [11]


def messages_of(bus: EmbeddedBus, suffix: str) -> list:
    return [c for c, _ in messages(bus) if c.namespace.endswith(suffix)]


def test_heartbeats_move_a_quiet_slot(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    execute(dsn, "create table watched (id int primary key)", "create table other (id int)")
    config = reader_config(dsn, tables=["watched"])
    with running(config, bus, tmp_path / "state"):
        copied(bus)
        execute(dsn, "insert into watched values (1)")
        wait_until("the insert", lambda: rows(bus, Op.INSERT))
        first = wait_until("an acknowledgement", lambda: slot_confirmed(dsn, config.slot_name()))
        execute(dsn, "insert into other select generate_series(1, 1000)")
        wait_until(
            "the slot past the other table's traffic",
            lambda: slot_confirmed(dsn, config.slot_name()) > first,
        )
    assert not [c for c, _ in messages(bus) if c.namespace.endswith(".other")]


def test_bad_config_names_what_is_wrong(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    from headwater.transport.postgres.catalog import SourceError

    execute(dsn, "create table t (id int primary key)")
    nope = reader_config(dsn, tables=["nope"])
    with (
        pytest.raises(SourceError, match="table 'nope' does not exist"),
        running(nope, bus, tmp_path),
    ):
        pass
    none = reader_config(dsn, tables="zzz.*")
    with (
        pytest.raises(SourceError, match="no table of the source matches"),
        running(none, bus, tmp_path),
    ):
        pass


def test_partitions(dsn: str, bus: EmbeddedBus, tmp_path: Path) -> None:
    """With several partitions a row's changes stay in one, and the schema and truncate
    messages go to every one, ahead of the rows they concern."""
    execute(dsn, "create table t (id int primary key, v int)")
    with running(reader_config(dsn, partitions=3), bus, tmp_path / "state"):
        copied(bus, 3)
        execute(dsn, "insert into t select g, 0 from generate_series(1, 30) g")
        execute(dsn, "update t set v = 1", "truncate t")
        wait_until("3 truncates", lambda: sum(c.op == Op.TRUNCATE for c, _ in messages(bus)) == 3)
    topic = next(t for t in bus.topics() if t.name.startswith("cdc.src."))
    assert topic.partitions == 3
    for p in range(3):
        records = bus.read(topic.name, p, 0, max_records=1000)
        ops = [decode(r)[0].op for r in records]
        assert ops[0] == Op.SCHEMA and ops[-1] == Op.TRUNCATE and ops.count(Op.INSERT) > 0
        keys = {}
        for r in records:
            c, _ = decode(r)
            if c.key:
                keys.setdefault(c.key["id"], []).append(c.op)
        assert all(v == [Op.INSERT, Op.UPDATE] for v in keys.values())
