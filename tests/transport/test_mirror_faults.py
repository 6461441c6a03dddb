"""The issue's mirror proof: a PostgreSQL table (every value kind, large TOASTed values) gets
10,000 random inserts, updates (some only of non-TOAST columns of rows with large values),
deletes and one truncate, while ``headwater transport`` (the CDC reader) and ``headwater
pipeline`` (two mirror destinations, stream mode) are each SIGKILLed at random moments, 6 times.
At the end the DuckDB and the PostgreSQL mirrors equal the source row for row, column for
column."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pytest
from tests.transport.pg_source import execute, reader_config, slot_of, wait_caught_up
from tests.transport.test_mirror import norm

from headwater.testing.collector import CollectorProcess
from headwater.testing.pipeline_process import start_pipeline, stop

pytestmark = pytest.mark.slow
KILLS = 6
OPERATIONS = 10_000
TABLE = """create table items (
    id int primary key, price numeric(10, 2), seen timestamptz, attrs jsonb, tags text[],
    raw bytea, ref uuid, score float8, note text, body text)"""
COLUMNS = "id, price, seen, attrs, tags, raw, ref, score, note, body"


def write_config(tmp_path: Path, source: str, target: str) -> Path:
    mirror = {"apply": "upsert", "mode": "stream", "trigger_interval_s": 0.5}
    doc = {
        "data_dir": str(tmp_path / "data"),
        "transport": {
            "readers": [
                reader_config(source, tables=["items"], partitions=2, heartbeat_s=1).model_dump(
                    mode="json"
                )
            ]
        },
        "pipeline": {
            "destinations": [
                {"id": "duck", "type": "duckdb", "path": str(tmp_path / "m.duckdb"), **mirror},
                {"id": "pg", "type": "postgres", "dsn": target, **mirror},
            ]
        },
    }
    path = tmp_path / "headwater.yaml"
    path.write_text(json.dumps(doc))
    return path


def operate(dsn: str, stop_event: threading.Event, done: list[int], seed: int) -> None:
    """Random changes until ``OPERATIONS`` are made (or told to stop)."""
    rng = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as c:
        for n in range(OPERATIONS):
            if stop_event.is_set():
                return
            i = rng.randint(1, 1500)
            kind = rng.random()
            if n == OPERATIONS // 2:
                c.execute("truncate items")
            elif kind < 0.45:
                big = "B" * rng.choice([10, 5000, 30000]) + str(n)
                c.execute(
                    "insert into items values (%s, %s, now(), %s, %s, %s, gen_random_uuid(), "
                    "%s, %s, %s) on conflict (id) do update set price = excluded.price, "
                    "body = excluded.body",
                    (
                        i,
                        f"{n % 1000}.{n % 100:02d}",
                        json.dumps({"n": n, "nested": {"k": [1, None, "x"]}}),
                        ["a", None, f"t{n}"],
                        bytes([n % 256, 1, 2]),
                        rng.random() * 1000,
                        None if n % 7 == 0 else f"note {n}",
                        big,
                    ),
                )
            elif kind < 0.80:  # only non-TOAST columns: a large body stays unchanged
                c.execute(
                    "update items set note = %s, score = score + 1 where id = %s", (f"u{n}", i)
                )
            else:
                c.execute("delete from items where id = %s", (i,))
            done.append(n)


def rows(fetch: Any) -> dict[Any, tuple[Any, ...]]:
    return {r[0]: tuple(norm(v) for v in r) for r in fetch}


def differences(expected: dict[Any, Any], got: dict[Any, Any]) -> list[str]:
    """What differs, row by row and column by column (the first 10)."""
    names = COLUMNS.split(", ")
    out = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    out += [f"extra {k}" for k in sorted(set(got) - set(expected))]
    for k in sorted(set(expected) & set(got)):
        if expected[k] != got[k]:
            cols = [
                f"{n}: {str(a)[:30]!r} != {str(b)[:30]!r}"
                for n, a, b in zip(names, expected[k], got[k], strict=True)
                if a != b
            ]
            out.append(f"row {k}: {'; '.join(cols)}")
    return out[:10]


def test_mirrors_equal_the_source_after_kills(source: str, target: str, tmp_path: Path) -> None:
    execute(source, TABLE, "alter table items alter column body set storage external")
    execute(
        source,
        "insert into items select g, g, now(), '{}', '{}', '\\x00', gen_random_uuid(), g, "
        "'first', repeat('x', 3000) from generate_series(1, 500) g",
    )
    config = write_config(tmp_path, source, target)
    rng = random.Random(7)
    stop_event = threading.Event()
    done: list[int] = []
    writer = threading.Thread(target=operate, args=(source, stop_event, done, 11), daemon=True)
    reader: CollectorProcess | None = None
    pipeline: subprocess.Popen[bytes] | None = None
    try:
        reader = CollectorProcess(config, tmp_path / "reader-0.log", ("transport", "--port", "0"))
        reader.wait_healthy()
        pipeline = start_pipeline(config, tmp_path / "pipeline.log")
        writer.start()
        for k in range(KILLS):
            stop_event.wait(rng.uniform(2.0, 6.0))  # a random moment
            reader.close()  # SIGKILL
            reader = CollectorProcess(
                config, tmp_path / f"reader-{k + 1}.log", ("transport", "--port", "0")
            )
            reader.wait_healthy()
            stop_event.wait(rng.uniform(1.0, 4.0))
            stop(pipeline)  # SIGKILL of the process group
            pipeline = start_pipeline(config, tmp_path / "pipeline.log")
        writer.join(600)
        assert len(done) == OPERATIONS
        wait_caught_up(source, slot_of(source), timeout=300)
        assert reader.stop() == 0
        stop(pipeline, signal.SIGTERM)
        pipeline = None
    finally:
        stop_event.set()
        if reader is not None:
            reader.close()
        if pipeline is not None:
            stop(pipeline)
    once = start_pipeline(config, tmp_path / "pipeline.log", "--once")
    assert once.wait(600) == 0, (tmp_path / "pipeline.log").read_text()[-3000:]
    with psycopg.connect(source) as c:
        expected = rows(c.execute(f"select {COLUMNS} from items").fetchall())
    with duckdb.connect(str(tmp_path / "m.duckdb"), read_only=True) as c:
        assert (
            differences(expected, rows(c.execute(f"select {COLUMNS} from items").fetchall())) == []
        )
    with psycopg.connect(target) as c:
        assert (
            differences(expected, rows(c.execute(f"select {COLUMNS} from items").fetchall())) == []
        )
    assert len(expected) > 100
