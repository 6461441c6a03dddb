"""Scale-out proof: the same pipeline, unchanged, on Spark clusters of separate executor JVMs.

``headwater pipeline --once --master M`` writes a four-partition topic into DuckDB and then into
PostgreSQL, with M ``local-cluster[2,1,1024]`` (two executor JVMs started by the driver) and a
standalone master with two workers started from PySpark's own ``bin/spark-class``. While each
destination's write job runs (some of its tasks have staged their part, the batch is not
committed), one executor, or a whole worker, is SIGKILLed: Spark runs the lost tasks again
elsewhere, the driver commits the batch once, and each event is in each destination exactly once.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import duckdb
import psycopg
import pytest
import yaml

from headwater.bus import open_bus
from headwater.config.model import HeadwaterConfig
from headwater.destinations.postgres.client import STAGING_SCHEMA
from headwater.testing.pipeline import track_message
from headwater.testing.postgres import PostgresService
from headwater.testing.spark_cluster import SparkCluster, start_spark_cluster

EVENTS = 200_000
PARTITIONS = 4
TOPIC = "events-scale"
RUN_DEADLINE_S = 420.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass
class Run:
    """A ``headwater pipeline --once`` child and what it printed, with the time of each line."""

    child: subprocess.Popen[bytes]
    lines: queue.Queue[tuple[float, str]] = field(default_factory=queue.Queue)
    seen: list[tuple[float, str]] = field(default_factory=list)

    def pump(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in stream:
                self.lines.put((time.monotonic(), raw.decode(errors="replace")))

    def drain(self) -> None:
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())

    def first(self, needle: str) -> float | None:
        self.drain()
        return next((t for t, line in self.seen if needle in line), None)

    def text(self) -> str:
        self.drain()
        return "".join(line for _, line in self.seen)[-4000:]


def write_config(tmp_path: Path, dsn: str) -> Path:
    path = tmp_path / "headwater.yaml"
    config = {
        "data_dir": str(tmp_path / "data"),
        "bus": {"embedded": {"durability": "never"}},
        "pipeline": {
            "destinations": [
                {"id": "wh", "type": "duckdb", "mode": "batch", "topics": [TOPIC]},
                {"id": "pg", "type": "postgres", "dsn": dsn, "mode": "batch", "topics": [TOPIC]},
            ]
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def fill(config: HeadwaterConfig) -> None:
    with open_bus(config) as bus:
        bus.create_topic(TOPIC, PARTITIONS)
        for start in range(0, EVENTS, 50_000):
            messages = [track_message(i) for i in range(start, start + 50_000)]
            bus.append(TOPIC, messages).result(timeout=60)


def executors() -> list[int]:
    """The pids of the executor JVMs on this machine (the tests run one at a time)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"CoarseGrainedExecutorBackend" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def duckdb_staged(config: HeadwaterConfig) -> bool:
    staging = config.warehouse_path().with_name(config.warehouse_path().name + ".staging")
    return staging.exists() and any(p.is_file() for p in staging.rglob("*.parquet"))


def postgres_staged(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        (count,) = conn.execute(
            "select count(*) from pg_tables where schemaname = %s", (STAGING_SCHEMA,)
        ).fetchone() or (0,)
    return int(count) > 0


def kill_when(staged: Callable[[], bool], victim: Callable[[], int], run: Run) -> float:
    """SIGKILL ``victim()`` as soon as ``staged()`` (some tasks have staged their part);
    returns when it was killed."""
    deadline = time.monotonic() + RUN_DEADLINE_S
    while time.monotonic() < deadline and run.child.poll() is None:
        if staged():
            os.kill(victim(), signal.SIGKILL)
            return time.monotonic()
        time.sleep(0.02)  # polling a condition, with a deadline
    raise AssertionError(f"no staged part before the deadline or exit:\n{run.text()}")


def start_pipeline(config_file: Path, master: str) -> Run:
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "headwater", "--config", str(config_file), "pipeline"]
    child = subprocess.Popen(
        [*command, "--once", "--master", master],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    run = Run(child)
    assert child.stderr is not None
    threading.Thread(target=run.pump, args=(child.stderr,), daemon=True).start()
    return run


def any_executor() -> int:
    pids = executors()
    assert pids, "no executor JVM is running"
    return pids[0]


def check_exactly_once(config: HeadwaterConfig, dsn: str) -> None:
    query = "select count(*), count(distinct eventn_ctx_event_id) from events"
    assert not duckdb_staged(config), "staged Parquet left behind"
    with closing(duckdb.connect(str(config.warehouse_path()), read_only=True)) as conn:
        assert conn.execute(query).fetchone() == (EVENTS, EVENTS)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(query).fetchone() == (EVENTS, EVENTS)
        leftover = conn.execute(
            "select count(*) from pg_tables where schemaname = %s", (STAGING_SCHEMA,)
        ).fetchone()
        assert leftover == (0,), "staging tables left behind"


def run_with_kills(
    tmp_path: Path, dsn: str, master: str, victims: tuple[Callable[[], int], ...]
) -> None:
    config_file = write_config(tmp_path, dsn)
    config = HeadwaterConfig.model_validate(yaml.safe_load(config_file.read_text()))
    fill(config)
    run = start_pipeline(config_file, master)
    try:
        killed_wh = kill_when(lambda: duckdb_staged(config), victims[0], run)
        killed_pg = kill_when(lambda: postgres_staged(dsn), victims[1], run)
        code = run.child.wait(timeout=RUN_DEADLINE_S)
        assert code == 0, run.text()
    finally:
        if run.child.poll() is None:
            os.killpg(run.child.pid, signal.SIGKILL)
            run.child.wait(30)
    # each kill landed while its destination's batch was still being written
    committed_wh = run.first("destination wh batch")
    committed_pg = run.first("destination pg batch")
    assert committed_wh is not None and committed_pg is not None, run.text()
    assert killed_wh < committed_wh and killed_pg < committed_pg
    lost = [t for t, line in run.seen if "Lost executor" in line]  # Spark's scheduler noticed
    assert any(t > killed_wh for t in lost) and any(t > killed_pg for t in lost), run.text()
    # read by as many tasks as the topic has partitions (or more)
    for line in (line for _, line in run.seen if " batch " in line and "task(s)" in line):
        assert int(line.split(" task(s)")[0].rsplit(" ", 1)[1]) >= PARTITIONS, line
    check_exactly_once(config, dsn)


@pytest.fixture
def database(postgres_service: PostgresService, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "scale_" + request.node.name.split("[")[0].removeprefix("test_")[:40]
    yield postgres_service.fresh_database(name)


def test_local_cluster_loses_an_executor_mid_write(tmp_path: Path, database: str) -> None:
    run_with_kills(tmp_path, database, "local-cluster[2,1,1024]", (any_executor, any_executor))


def test_standalone_cluster_loses_a_worker_and_an_executor(tmp_path: Path, database: str) -> None:
    with start_spark_cluster(workers=2) as cluster:
        run_with_kills(
            tmp_path, database, cluster.url, (lambda: first_worker(cluster), any_executor)
        )


def first_worker(cluster: SparkCluster) -> int:
    """The first worker JVM (its executor goes with it)."""
    return cluster.workers[0].pid
