"""Writers survive their destination: while a destination is unavailable for a minute (another
process holds the DuckDB file, PostgreSQL is stopped), the writer's query fails, says why in the
status, is retried with backoff in the running process, and once the destination is back every
event lands exactly once. Stream and batch modes.

The bus is open in this process (it holds the log's write lock, as the collector does); Spark's
Python workers read the log read-only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from headwater.bus import Bus, context, open_bus
from headwater.bus.records import Message
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.runner import Pipeline
from headwater.pipeline.status import Backoff, DestinationStatus, read_status
from headwater.testing import postgres as pg

HOLD_S = 60.0
TIMEOUT_S = 120.0
FAST = Backoff(initial_s=0.5, max_s=3.0)


def make_config(tmp_path: Path, dest: dict[str, Any]) -> HeadwaterConfig:
    base = {"id": "wh", "table_name_template": "events", "trigger_interval_s": 0.5}
    return HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": [{**base, **dest}]}}
    )


def append(bus: Bus, start: int, count: int) -> None:
    messages = [
        Message(
            json.dumps({"n": i, "user": f"u{i % 7}"}).encode(),
            key=f"u{i % 7}".encode(),
            headers=(
                (context.TYPE, b"track"),
                (context.CONTENT_TYPE, b"application/json"),
                (context.EVENT_ID, f"ev-{i:05d}".encode()),
            ),
        )
        for i in range(start, start + count)
    ]
    bus.append("events-track", messages).result(timeout=30)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def status(config: HeadwaterConfig) -> DestinationStatus:
    written = read_status(config)
    assert written is not None
    return written.destinations[0]


def failing_with(config: HeadwaterConfig, code: str) -> bool:
    s = status(config)
    return s.state == "retrying" and s.consecutive_failures >= 1 and s.last_error_code == code


@contextmanager
def running(config: HeadwaterConfig, spark: Any) -> Iterator[tuple[Bus, Pipeline]]:
    bus = open_bus(config)
    pipeline = Pipeline(config, spark, backoff=FAST)
    try:
        pipeline.start()
        yield bus, pipeline
    finally:
        pipeline.stop()
        bus.close()


def duck_counts(config: HeadwaterConfig) -> tuple[int, int]:
    """Read as ``headwater sql`` does, from another process (DuckDB refuses a read-only
    connection in the process that writes the file)."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from headwater.ops.sql_cmds import query\n"
        "try:\n"
        "    _, rows = query(Path(sys.argv[1]), 'select count(*), count(distinct n) from events')\n"
        "except Exception:\n"  # no table yet
        "    rows = [(0, 0)]\n"
        "print(json.dumps(list(rows[0])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(config.warehouse_path())],
        capture_output=True,
        check=True,
        timeout=60,
    )
    n, distinct = json.loads(out.stdout)
    return (n, distinct)


@pytest.mark.parametrize("mode", ["stream", "batch"])
def test_a_reader_holding_the_duckdb_file_delays_rows_but_loses_none(
    spark: Any, tmp_path: Path, mode: str
) -> None:
    config = make_config(tmp_path, {"type": "duckdb", "mode": mode, "batch_period_s": 1.0})
    with running(config, spark) as (bus, _pipeline):
        append(bus, 0, 50)
        wait_for(lambda: duck_counts(config) == (50, 50), "the first 50 rows")
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import duckdb, sys, time\n"
                "c = duckdb.connect(sys.argv[1], read_only=True)\n"
                "print('held', flush=True)\n"
                "time.sleep(float(sys.argv[2]))\n",
                str(config.warehouse_path()),
                str(HOLD_S),
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            holder.stdout.close()
            append(bus, 50, 50)
            # the writer waits out its lock timeout, fails, and says why
            wait_for(lambda: failing_with(config, "HW-DST-002"), "the lock failure in the status")
            assert holder.poll() is None, "the reader let go before the failure was reported"
            assert "lock" in (status(config).last_error or "").lower()
            assert holder.wait(timeout=HOLD_S + 30) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
        wait_for(lambda: duck_counts(config) == (100, 100), "every event once after the hold")
        wait_for(lambda: status(config).state == "running", "the destination healthy again")
        append(bus, 100, 10)
        wait_for(lambda: duck_counts(config) == (110, 110), "later events too")
    assert status(config).state == "stopped"


@pytest.fixture
def own_postgres() -> Iterator[pg.PostgresService]:
    """A cluster of this test's own, since the test stops it (the session's is shared)."""
    with pg.start_postgres() as service:
        yield service


def restart_postgres(service: pg.PostgresService) -> None:
    base = service.data_dir.parent
    pg._start(
        pg.postgres_bindir(),
        pg._server_os_user(),
        base,
        service.data_dir,
        base / "postgres.log",
        service.port,
    )


def pg_counts(dsn: str) -> tuple[int, int]:
    try:
        with closing(psycopg.connect(dsn, connect_timeout=2)) as c:
            row = c.execute("select count(*), count(distinct n) from events").fetchone()
    except psycopg.Error:
        return (0, 0)
    assert row is not None
    return (int(row[0]), int(row[1]))


@pytest.mark.parametrize("mode", ["stream", "batch"])
def test_postgres_stopped_for_a_minute_loses_no_event(
    spark: Any, tmp_path: Path, own_postgres: pg.PostgresService, mode: str
) -> None:
    dsn = own_postgres.dsn
    config = make_config(
        tmp_path, {"type": "postgres", "dsn": dsn, "mode": mode, "batch_period_s": 1.0}
    )
    with running(config, spark) as (bus, _pipeline):
        append(bus, 0, 50)
        wait_for(lambda: pg_counts(dsn) == (50, 50), "the first 50 rows")
        pg._stop(pg.postgres_bindir(), pg._server_os_user(), own_postgres.data_dir)
        stopped_at = time.monotonic()
        try:
            append(bus, 50, 50)
            wait_for(lambda: status(config).consecutive_failures >= 1, "a failure in the status")
            assert status(config).last_error
            time.sleep(max(0.0, HOLD_S - (time.monotonic() - stopped_at)))  # the outage itself
            assert status(config).state == "retrying"
        finally:
            restart_postgres(own_postgres)
        wait_for(lambda: pg_counts(dsn) == (100, 100), "every event once after the restart")
        wait_for(lambda: status(config).state == "running", "the destination healthy again")
    assert os.path.exists(config.data_dir / "status" / "pipeline.json")
