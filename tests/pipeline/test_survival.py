"""Writers survive their destination: while a destination is unavailable for a minute (another
process holds the DuckDB file, PostgreSQL is stopped), the writer's query fails, says why in the
status, is retried with backoff in the running process, and once the destination is back every
event lands exactly once. A stream-mode and a batch-mode destination face the same outage side
by side (one pipeline, two queries).

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


MODES = ("stream", "batch")


def make_config(tmp_path: Path, dest: Callable[[str], dict[str, Any]]) -> HeadwaterConfig:
    """A destination per mode, with the id of its mode, the rest from ``dest(mode)``."""
    base = {"table_name_template": "events", "trigger_interval_s": 0.5, "batch_period_s": 1.0}
    destinations = [{**base, "id": mode, "mode": mode, **dest(mode)} for mode in MODES]
    return HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": destinations}}
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


def status(config: HeadwaterConfig, dest: str) -> DestinationStatus:
    written = read_status(config)
    assert written is not None
    return next(d for d in written.destinations if d.destination == dest)


def every(config: HeadwaterConfig, check: Callable[[DestinationStatus], bool]) -> bool:
    return all(check(status(config, mode)) for mode in MODES)


def failing_with(config: HeadwaterConfig, code: str) -> bool:
    return every(
        config,
        lambda s: (
            s.state == "retrying" and s.consecutive_failures >= 1 and s.last_error_code == code
        ),
    )


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


def duck_path(tmp_path: Path, mode: str) -> Path:
    return tmp_path / f"{mode}.duckdb"


def duck_counts(path: Path) -> tuple[int, int]:
    """Read as ``headwater sql`` does, from another process (DuckDB refuses a read-only
    connection in the process that writes the file)."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from headwater.ops.warehouse import query\n"
        "try:\n"
        "    _, rows = query(Path(sys.argv[1]), 'select count(*), count(distinct n) from events')\n"
        "except Exception:\n"  # no table yet
        "    rows = [(0, 0)]\n"
        "print(json.dumps(list(rows[0])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    n, distinct = json.loads(out.stdout)
    return (n, distinct)


def test_a_reader_holding_the_duckdb_file_delays_rows_but_loses_none(
    spark: Any, tmp_path: Path
) -> None:
    config = make_config(
        tmp_path, lambda mode: {"type": "duckdb", "path": str(duck_path(tmp_path, mode))}
    )
    paths = [duck_path(tmp_path, mode) for mode in MODES]

    def counts_are(n: int) -> bool:
        return all(duck_counts(p) == (n, n) for p in paths)

    with running(config, spark) as (bus, _pipeline):
        append(bus, 0, 50)
        wait_for(lambda: counts_are(50), "the first 50 rows")
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import duckdb, sys, time\n"
                "held = [duckdb.connect(p, read_only=True) for p in sys.argv[2:]]\n"
                "print('held', flush=True)\n"
                "time.sleep(float(sys.argv[1]))\n",
                str(HOLD_S),
                *map(str, paths),
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            holder.stdout.close()
            append(bus, 50, 50)
            # the writers wait out their lock timeout, fail, and say why
            wait_for(lambda: failing_with(config, "HW-DST-002"), "the lock failure in the status")
            assert holder.poll() is None, "the reader let go before the failure was reported"
            assert every(config, lambda s: "lock" in (s.last_error or "").lower())
            assert holder.wait(timeout=HOLD_S + 30) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
        wait_for(lambda: counts_are(100), "every event once after the hold")
        wait_for(lambda: every(config, lambda s: s.state == "running"), "healthy again")
        append(bus, 100, 10)
        wait_for(lambda: counts_are(110), "later events too")
    assert every(config, lambda s: s.state == "stopped")


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


def pg_counts(dsn: str, table: str) -> tuple[int, int]:
    try:
        with closing(psycopg.connect(dsn, connect_timeout=2)) as c:
            row = c.execute(f"select count(*), count(distinct n) from {table}").fetchone()
    except psycopg.Error:
        return (0, 0)
    assert row is not None
    return (int(row[0]), int(row[1]))


@pytest.mark.outage
def test_postgres_stopped_for_a_minute_loses_no_event(
    spark: Any, tmp_path: Path, own_postgres: pg.PostgresService
) -> None:
    dsn = own_postgres.dsn
    config = make_config(
        tmp_path,
        lambda mode: {"type": "postgres", "dsn": dsn, "table_name_template": f"events_{mode}"},
    )

    def counts_are(n: int) -> bool:
        return all(pg_counts(dsn, f"events_{mode}") == (n, n) for mode in MODES)

    with running(config, spark) as (bus, _pipeline):
        append(bus, 0, 50)
        wait_for(lambda: counts_are(50), "the first 50 rows")
        pg._stop(pg.postgres_bindir(), pg._server_os_user(), own_postgres.data_dir)
        stopped_at = time.monotonic()
        try:
            append(bus, 50, 50)
            wait_for(
                lambda: every(config, lambda s: s.consecutive_failures >= 1),
                "a failure in the status",
            )
            assert every(config, lambda s: bool(s.last_error))
            time.sleep(max(0.0, HOLD_S - (time.monotonic() - stopped_at)))  # the outage itself
            assert every(config, lambda s: s.state == "retrying")
        finally:
            restart_postgres(own_postgres)
        wait_for(lambda: counts_are(100), "every event once after the restart")
        wait_for(lambda: every(config, lambda s: s.state == "running"), "healthy again")
    assert os.path.exists(config.data_dir / "status" / "pipeline.json")
