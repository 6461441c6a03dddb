"""Mirrors (``apply: upsert``): a PostgreSQL table read by the CDC reader onto the embedded log,
then applied by the pipeline into DuckDB, another PostgreSQL database, ClickHouse (chdb) and a
Delta table (read back by delta-rs), which end equal to the source row for row and column for
column; a bad change among many is
isolated; with ``on_error: stop`` the destination stays at its last committed batch."""

from __future__ import annotations

import base64
import json
import math
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pytest
from click.testing import CliRunner
from tests.transport.pg_source import (
    execute,
    messages,
    reader_config,
    running,
    wait_until,
)

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.cli.main import cli as main_cli
from headwater.config.model import HeadwaterConfig
from headwater.destinations import open_destination
from headwater.pipeline.failed import FailedStore
from headwater.pipeline.runner import Pipeline
from headwater.testing.s3 import S3Service
from headwater.testing.warehouse import delta_query
from headwater.transport.message import Change, Mode, Op, encode

pytestmark = pytest.mark.slow

TABLE = """create table kinds (
    id bigint primary key, n numeric(12, 2), ts timestamptz, j jsonb, ints int[], b bytea,
    u uuid, f float8, ok boolean, note text)"""
COLUMNS = "id, n, ts, j, ints, b, u, f, ok, note"


def config_for(
    tmp_path: Path,
    target: str,
    clickhouse: Path | None = None,
    s3: S3Service | None = None,
    **dest: Any,
) -> HeadwaterConfig:
    common = {"apply": "upsert", "topic_pattern": r"cdc\..*", **dest}
    destinations = [
        {"id": "duck", "type": "duckdb", "path": str(tmp_path / "m.duckdb"), **common},
        {"id": "pg", "type": "postgres", "dsn": target, **common},
        {"id": "lake", "type": "delta", "path": str(tmp_path / "lake"), **common},
    ]
    if s3 is not None:  # Delta tables on the S3 server too
        bucket = s3.create_bucket(f"mirror-{uuid.uuid4().hex[:12]}")
        lake = {"path": f"s3a://{bucket}/lake", "options": {"storage_options": s3.storage_options}}
        destinations.append({"id": "lake-s3", "type": "delta", **lake, **common})
    if clickhouse is not None:  # chdb: one data folder per process, a database per test
        database = {"database": f"m{uuid.uuid4().hex[:12]}"}
        ch = {"id": "ch", "type": "clickhouse", "path": str(clickhouse), "options": database}
        destinations.append({**ch, **common})
    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "bus": {"embedded": {"durability": "never"}},
            "pipeline": {"destinations": destinations},
        }
    )


def clickhouse_rows(config: HeadwaterConfig, select: str) -> list[tuple[Any, ...]]:
    """Rows of the ClickHouse mirror: ``select`` with {db} for its database."""
    from headwater.destinations.clickhouse.client import embedded_session

    ch = next(d for d in config.pipeline.destinations if d.type == "clickhouse")
    assert ch.path is not None
    sql = select.format(db=f"`{ch.options['database']}`")
    result = embedded_session(ch.path).query(sql, "ArrowTable")
    return [tuple(r.values()) for r in result.to_pylist()]


def read_into_log(dsn: str, log_dir: Path, state: Path, until: int) -> None:
    """Run the reader until the log holds ``until`` changes (reads, inserts, ...)."""
    bus = EmbeddedBus(log_dir)
    try:
        with running(reader_config(dsn, partitions=2), bus, state):
            wait_until(
                f"{until} changes",
                lambda: (
                    sum(c.op not in (Op.SCHEMA, Op.COMPLETE) for c, _ in messages(bus)) >= until
                ),
            )
    finally:
        bus.close()


def norm(v: Any) -> Any:
    """A value as both sides can be compared on."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, dict | list) and not (
        isinstance(v, list) and all(isinstance(x, int | None) for x in v)
    ):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.dumps(json.loads(v), sort_keys=True)
        except ValueError:
            return v
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, uuid.UUID):
        return str(v)
    return v


def table_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted(tuple(norm(v) for v in r) for r in rows)


def source_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as c:
        return table_rows(c.execute(f"select {COLUMNS} from kinds").fetchall())


def delta_rows(config: HeadwaterConfig, sql: str, mirror: str = "lake") -> list[tuple[Any, ...]]:
    """Rows of ``sql`` over the Delta mirror ``mirror``, read by delta-rs."""
    dest = next(d for d in config.pipeline.destinations if d.id == mirror)
    d = open_destination(dest, config.data_dir)
    try:
        return delta_query(d, sql)
    finally:
        d.close()


def duck_rows(path: Path) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(path), read_only=True) as c:
        return table_rows(c.execute(f"select {COLUMNS} from kinds").fetchall())


def row_sql(i: int) -> str:
    blob = base64.b64encode(bytes([i % 256, 0, 255])).decode()
    f = "'NaN'" if i % 10 == 0 else i / 3
    return (
        f"({i}, {i}.25, '2024-01-01 00:00:00+00'::timestamptz + interval '{i} seconds', "
        f"'{{\"i\": {i}, \"tags\": [\"a\", null]}}', '{{{i},NULL}}', decode('{blob}', 'base64'), "
        f"gen_random_uuid(), {f}, {str(i % 2 == 0).lower()}, "
        f"{'NULL' if i % 5 == 0 else repr('note ' + str(i))})"
    )


def test_a_table_is_mirrored_into_duckdb_postgres_clickhouse_and_delta(
    spark: Any, source: str, target: str, tmp_path: Path, chdb_path: Path, s3_server: S3Service
) -> None:
    execute(
        source, TABLE, f"insert into kinds values {', '.join(row_sql(i) for i in range(1, 201))}"
    )
    config = config_for(tmp_path, target, chdb_path, s3_server)
    state = tmp_path / "state"
    read_into_log(source, config.log_dir(), state, 200)
    execute(
        source,
        f"insert into kinds values {', '.join(row_sql(i) for i in range(201, 301))}",
        "update kinds set note = 'changed', n = n + 1 where id % 3 = 0",
        "update kinds set id = id + 10000 where id = 7",
        "delete from kinds where id % 4 = 0",
        "alter table kinds add column extra text",
        "update kinds set extra = 'x' || id where id < 50",
    )
    changes = 100 + 100 + 2 + 75 + 36  # inserts, updates, the key change (delete + update), ...
    read_into_log(source, config.log_dir(), state, 200 + changes)
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()
    expected = source_rows(source)
    assert len(expected) == 300 - 75 and duck_rows(tmp_path / "m.duckdb") == expected
    assert source_rows(target) == expected
    # ClickHouse's String holds the bytes; chdb hands Strings over as UTF-8: compared as hex
    ch_columns = COLUMNS.replace(" b,", " lower(hex(b)),")
    ch = clickhouse_rows(config, f"SELECT {ch_columns} FROM {{db}}.kinds FINAL")
    as_hex = [tuple(v.hex() if isinstance(v, bytes) else v for v in r) for r in expected]
    assert table_rows(ch) == as_hex
    assert table_rows(delta_rows(config, f"SELECT {COLUMNS} FROM kinds")) == expected
    assert table_rows(delta_rows(config, f"SELECT {COLUMNS} FROM kinds", "lake-s3")) == expected
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        extra = dict(c.execute("select id, extra from kinds where extra is not null").fetchall())
    assert extra == {i: f"x{i}" for i in range(1, 50) if i % 4 and i != 7}


def test_truncate_and_toast(
    spark: Any, source: str, target: str, tmp_path: Path, chdb_path: Path
) -> None:
    execute(
        source,
        "create table docs (id int primary key, title text, body text)",
        "alter table docs alter column body set storage external",
        "insert into docs select g, 't' || g, repeat('x', 10000) || g "
        "from generate_series(1, 20) g",
    )
    config = config_for(tmp_path, target, chdb_path)
    state = tmp_path / "state"
    read_into_log(source, config.log_dir(), state, 20)
    Pipeline(config, spark).run_once()
    execute(
        source,
        "update docs set title = 'new' where id <= 10",  # body unchanged: not sent
        "truncate docs",
        "insert into docs select g, 'again', repeat('y', 9000) from generate_series(1, 5) g",
        "update docs set title = 'newer' where id = 1",
    )
    # the truncate is written on both partitions: waiting for one copy let the reader stop
    # before the last update was on the log
    read_into_log(source, config.log_dir(), state, 20 + 10 + 2 + 5 + 1)
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()
    with psycopg.connect(source) as c:
        expected = sorted(c.execute("select id, title, body from docs").fetchall())
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        assert sorted(c.execute("select id, title, body from docs").fetchall()) == expected
    with psycopg.connect(target) as c:
        assert sorted(c.execute("select id, title, body from docs").fetchall()) == expected
    assert sorted(clickhouse_rows(config, "SELECT id, title, body FROM {db}.docs FINAL")) == (
        expected
    )
    assert sorted(delta_rows(config, "SELECT id, title, body FROM docs")) == expected


def poison(log_dir: Path, topic: str, ids: list[int]) -> None:
    """Changes no warehouse can take (a numeric column given a word)."""
    bus = EmbeddedBus(log_dir)
    try:
        ns = next(c.namespace for c, _ in messages(bus) if c.op == Op.SCHEMA)
        bad = [
            encode(Change(Op.INSERT, ns, 1, {"id": i, "n": "not a number"}, {"id": i}), Mode.SYNC)
            for i in ids
        ]
        bus.append(topic, bad).result(30)
    finally:
        bus.close()


def test_isolate_fails_only_the_bad_changes(
    spark: Any, source: str, target: str, tmp_path: Path, chdb_path: Path
) -> None:
    execute(source, "create table t (id int primary key, n numeric(6,2))")
    execute(source, "insert into t select g, g / 100.0 from generate_series(1, 10000) g")
    config = config_for(tmp_path, target, chdb_path)
    state = tmp_path / "state"
    read_into_log(source, config.log_dir(), state, 10000)
    bus = EmbeddedBus(config.log_dir(), read_only=True)
    topic = next(t.name for t in bus.topics() if t.name.startswith("cdc."))
    bus.close()
    poison(config.log_dir(), topic, [20001, 20002, 20003])
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        assert c.execute("select count(*), min(id), max(id) from t").fetchone() == (10000, 1, 10000)
    with psycopg.connect(target) as c:
        assert c.execute("select count(*) from t").fetchone() == (10000,)
    assert clickhouse_rows(config, "SELECT count() FROM {db}.t FINAL") == [(10000,)]
    assert delta_rows(config, "SELECT count(*), min(id), max(id) FROM t") == [(10000, 1, 10000)]
    failed = FailedStore(config).events()
    assert sorted((f.destination, json.loads(f.value)["key"]["id"]) for f in failed) == sorted(
        (d, i) for d in ("duck", "pg", "ch", "lake") for i in (20001, 20002, 20003)
    )
    assert {f.step for f in failed} == {"apply"}


@pytest.mark.parametrize("mirror", ["duck", "lake"])
def test_stop_mode_then_step_and_set_offset(
    spark: Any, source: str, target: str, tmp_path: Path, mirror: str
) -> None:
    execute(source, "create table t (id int primary key, n numeric(6,2))")
    execute(source, "insert into t select g, 1 from generate_series(1, 10) g")
    config = config_for(tmp_path, target, on_error="stop")
    config_file = tmp_path / "headwater.yaml"
    config_file.write_text(config.model_dump_json())
    state = tmp_path / "state"
    read_into_log(source, config.log_dir(), state, 10)
    run_mirrors(config, spark, [mirror])
    topic = cdc_topic(config)
    poison(config.log_dir(), topic, [99])
    execute(source, "insert into t values (11, 2), (12, 3)")
    read_into_log(source, config.log_dir(), state, 13)
    with pytest.raises(Exception, match="on_error: stop"):
        run_mirrors(config, spark, [mirror])
    assert mirror_ids(config, mirror) == list(range(1, 11))  # the last committed batch's state

    cli = CliRunner()
    base = ["--config", str(config_file), "pipeline", "step", "-d", mirror, "--format", "json"]
    stepped = cli.invoke(main_cli, [*base, "-n", "100"])
    assert stepped.exit_code == 1, stepped.output
    steps = [json.loads(line) for line in stepped.output.splitlines()]
    *before, failed = steps
    assert failed["outcome"] == "failed" and "not a number" in failed["error"]
    assert all(s["outcome"] in ("applied", "skipped") for s in before)
    assert set(range(1, 11)) <= set(mirror_ids(config, mirror)) <= set(range(1, 13))
    again = cli.invoke(main_cli, [*base, "-n", "1"])  # stuck on it: the same failure
    assert again.exit_code == 1 and json.loads(again.output) == failed

    mark = cli.invoke(
        main_cli,
        [
            "--config",
            str(config_file),
            "log",
            "set-offset",
            "--group",
            mirror,
            failed["topic"],
            str(failed["partition"]),
            str(failed["offset"] + 1),
        ],
    )
    assert mark.exit_code == 0, mark.output
    execute(source, "insert into t values (13, 4)")
    read_into_log(source, config.log_dir(), state, 14)  # 13 rows and the poisoned change
    had = len(mirror_ids(config, mirror))
    one = cli.invoke(main_cli, [*base, "-n", "1"])
    assert one.exit_code == 0, one.output
    (moved,) = [json.loads(line) for line in one.output.splitlines()]  # exactly one message
    assert moved["outcome"] in ("applied", "skipped") and moved["offset"] != failed["offset"]
    assert len(mirror_ids(config, mirror)) - had == (moved["op"] == "insert")
    run_mirrors(config, spark, [mirror])
    assert mirror_ids(config, mirror) == list(range(1, 14))


def run_mirrors(config: HeadwaterConfig, spark: Any, only: list[str] | None = None) -> None:
    pipeline = Pipeline(config, spark, only)
    try:
        pipeline.run_once()
    finally:
        for q in pipeline.queries:
            q.writer.close()


def cdc_topic(config: HeadwaterConfig) -> str:
    bus = EmbeddedBus(config.log_dir(), read_only=True)
    try:
        return next(t.name for t in bus.topics() if t.name.startswith("cdc."))
    finally:
        bus.close()


def mirror_ids(config: HeadwaterConfig, mirror: str) -> list[int]:
    """The ids in mirror ``mirror``'s table t (duck: DuckDB; lake: Delta, by delta-rs)."""
    if mirror == "lake":
        dest = next(d for d in config.pipeline.destinations if d.id == "lake")
        d = open_destination(dest, config.data_dir)
        try:
            if d.table("t") is None:
                return []
            return [r[0] for r in delta_query(d, "select id from t order by id")]
        finally:
            d.close()
    return duck_ids(config.data_dir.parent)


def duck_ids(tmp_path: Path) -> list[int]:
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        return [r[0] for r in c.execute("select id from t order by id").fetchall()]


def test_functions_and_namespace_shape_the_mirror(
    spark: Any, source: str, target: str, tmp_path: Path
) -> None:
    execute(
        source,
        "create table t (id int primary key, secret text, name text, status text, note text)",
        "create table other (id int primary key)",
        "insert into other values (1)",
        "insert into t values (1, 's', 'a', 'paid', 'x'), (2, 's', 'b', 'open', 'y'), "
        "(3, 's', 'c', 'void', 'z'), (4, 's', 'd', 'test', 'w'), (5, 's', 'e', 'gone', 'v')",
    )
    functions = [
        {"name": "omit", "fields": ["secret"]},
        {"name": "rename", "fields": {"name": "full_name"}},
        {"name": "skip", "field": "data.status", "operator": "==", "match": "void"},
        {"name": "filter", "expression": "op <> 'read' OR data['status'] <> 'gone'"},
        {"name": "python", "function": "tests.transport.functions_sample:drop_tests"},
        {"name": "python", "function": "tests.transport.functions_sample:shout"},
    ]
    config = config_for(tmp_path, target, namespace=r".*\.public\.t", functions=functions)
    read_into_log(source, config.log_dir(), tmp_path / "state", 6)
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()
    expected = [(1, "a", "paid", "X"), (2, "b", "open", "Y")]
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        assert c.execute("select * from t order by id").fetchall() == expected
        names = [r[0] for r in c.execute("describe t").fetchall()]
        assert names == ["id", "full_name", "status", "note"]
        assert "other" not in {r[0] for r in c.execute("show tables").fetchall()}
    with psycopg.connect(target) as c:
        assert c.execute("select * from t order by id").fetchall() == expected
    # the dropped messages count as processed: a second run has no batch to do
    again = Pipeline(config, spark)
    again.run_once()
    for q in again.queries:
        q.writer.close()
        assert q.writer.batches == 0
