"""Pausing a destination: ``status.pause`` (from any process: it writes ``paused.json``) stops
the destination's query between batches within about a second, its state says ``paused``
(not failing for ``/readyz``), and nothing reaches it until ``status.resume``, after which
every event that arrived meanwhile lands exactly once. A destination paused before the pipeline
starts is not started. The status board keeps each destination's last batch; ``headwater
pipeline pause``/``resume``/``status`` work on the same file.

One pipeline runs a stream-mode and a batch-mode destination that get paused, and a
destination that never is: it writing the events appended during the pause is the sign that
the paused ones would have written them by then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import duckdb
import pytest
from tests.cli.test_status_sql import hw

from headwater.bus import Bus, context, open_bus
from headwater.bus.records import Message
from headwater.config import load_config
from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError
from headwater.pipeline.runner import Pipeline
from headwater.pipeline.status import (
    Backoff,
    DestinationStatus,
    Failure,
    LastBatch,
    StatusBoard,
    pause,
    paused,
    paused_path,
    read_status,
    resume,
    unhealthy,
)
from headwater.testing.waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_headwater_env")
TIMEOUT_S = 60.0
FAST = Backoff(initial_s=0.5, max_s=3.0)
HELD = ("held", "held-batch")  # paused and resumed; "live" never is


def make_config(tmp_path: Path) -> HeadwaterConfig:
    def dest(dest_id: str, mode: str) -> dict[str, Any]:
        return {
            "id": dest_id,
            "type": "duckdb",
            "path": str(tmp_path / f"{dest_id}.duckdb"),
            "mode": mode,
            "table_name_template": "events",
            "trigger_interval_s": 0.2,
            "batch_period_s": 0.5,
        }

    destinations = [dest("live", "stream"), dest("held", "stream"), dest("held-batch", "batch")]
    return HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": destinations}}
    )


def append(bus: Bus, start: int, count: int) -> None:
    messages = [
        Message(
            json.dumps({"n": i}).encode(),
            key=f"u{i % 5}".encode(),
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
    wait_until(condition, what, timeout)


def written(pipeline: Pipeline, dest: str) -> int:
    return next(q.writer.written for q in pipeline.queries if q.dest.id == dest)


def in_file(config: HeadwaterConfig, dest: str) -> DestinationStatus:
    status = read_status(config)
    assert status is not None
    return next(d for d in status.destinations if d.destination == dest)


def planned_batch(config: HeadwaterConfig, dest: str) -> int | None:
    """The last batch in the query's offset log (planned, committed or not)."""
    folder = config.checkpoint_dir() / dest / "offsets"
    batches = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    return max(batches, default=None)


def warehouse(tmp_path: Path, dest: str) -> tuple[int, int, int | None]:
    """Rows, distinct events and the ledger's last batch of a destination's DuckDB file (read
    in this process: only while its writer has the file closed, paused or stopped)."""
    with closing(duckdb.connect(str(tmp_path / f"{dest}.duckdb"), read_only=True)) as c:
        rows = c.execute("select count(*), count(distinct n) from events").fetchone()
        ledger = c.execute(
            "select max(batch_id) from _headwater_batches where writer_id = ?", [dest]
        ).fetchone()
    assert rows is not None and ledger is not None
    return int(rows[0]), int(rows[1]), ledger[0]


@pytest.fixture
def running(spark: Any, tmp_path: Path) -> Iterator[tuple[HeadwaterConfig, Bus, Pipeline]]:
    config = make_config(tmp_path)
    for dest in HELD:  # paused before the pipeline starts
        assert pause(config, dest, by="test")
    bus = open_bus(config)
    pipeline = Pipeline(config, spark, backoff=FAST)
    try:
        pipeline.start()
        yield config, bus, pipeline
    finally:
        pipeline.stop()
        bus.close()


def test_a_paused_destination_gets_nothing_until_resumed_then_every_event_once(
    running: tuple[HeadwaterConfig, Bus, Pipeline], tmp_path: Path
) -> None:
    config, bus, pipeline = running
    board = pipeline.status

    # paused at start: never started, while the live destination writes
    append(bus, 0, 20)
    wait_for(lambda: written(pipeline, "live") == 20, "the live destination's first 20 rows")
    for dest in HELD:
        wait_for(lambda d=dest: board.get(d).state == "paused", f"{dest} paused at start")
        assert in_file(config, dest).state == "paused"
        assert board.get(dest).attempts == 0
        assert planned_batch(config, dest) is None
        assert written(pipeline, dest) == 0
    assert unhealthy(board.all()) == {}  # paused is not failing

    # resumed: it starts from the beginning and writes what it missed
    for dest in HELD:
        assert resume(config, dest)
    for dest in HELD:
        wait_for(lambda d=dest: written(pipeline, d) == 20, f"{dest}: 20 rows once resumed")
        wait_for(lambda d=dest: board.get(d).last_batch is not None, f"{dest}: its last batch")
        last = board.get(dest).last_batch
        assert last is not None
        assert (last.rows, last.written, last.failed) == ({"events": 20}, 20, 0)
        assert last.batch_id == planned_batch(config, dest)  # the 20 came in one batch
        assert 0 < last.duration_s < TIMEOUT_S and abs(time.time() - last.committed_at) < 60
        assert board.get(dest).state == "running"
        # the file has it too, at most about a second later
        wait_for(lambda d=dest: in_file(config, d).last_batch is not None, f"{dest} in the file")

    # paused while running: its query stops, and its ledger and offsets stand still
    for dest in HELD:
        assert pause(config, dest, by="test")
    for dest in HELD:
        wait_for(lambda d=dest: board.get(d).state == "paused", f"{dest} paused", timeout=10)
    before = {d: (planned_batch(config, d), warehouse(tmp_path, d)) for d in HELD}
    for dest in HELD:
        assert before[dest][1][:2] == (20, 20)
    append(bus, 20, 30)
    wait_for(lambda: written(pipeline, "live") == 50, "the live destination's next 30 rows")
    for dest in HELD:
        assert (planned_batch(config, dest), warehouse(tmp_path, dest)) == before[dest]
        assert written(pipeline, dest) == 20
        assert board.get(dest).state == "paused"
        assert in_file(config, dest).state == "paused"
    assert unhealthy(board.all()) == {}

    # resumed: the 30 land, once
    for dest in HELD:
        assert resume(config, dest)
    for dest in HELD:
        wait_for(lambda d=dest: written(pipeline, d) == 50, f"{dest}: 50 rows once resumed")
        wait_for(lambda d=dest: board.get(d).state == "running", f"{dest} running again")

    # stop() while paused
    assert pause(config, "held", by="test")
    wait_for(lambda: board.get("held").state == "paused", "held paused again", timeout=10)
    pipeline.stop()
    assert all(q.finished.is_set() for q in pipeline.queries)
    assert {s.destination: s.state for s in board.all()} == dict.fromkeys(
        ("live", *HELD), "stopped"
    )
    for dest in ("live", *HELD):
        assert warehouse(tmp_path, dest)[:2] == (50, 50)


# --- the status board and the commands --------------------------------------------------------


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "pipeline:\n"
        "  destinations:\n"
        "    - {id: wh, type: duckdb, mode: stream}\n"
        "    - {id: pg, type: postgres, dsn: 'postgresql://x@127.0.0.1:1/x', mode: batch}\n"
    )
    return path


def test_pause_and_resume_commands(config_file: Path) -> None:
    config = load_config(config_file)
    assert paused(config) == {}
    assert hw(config_file, "pipeline", "pause", "wh", "--by", "alice").output.strip() == (
        "destination wh: paused"
    )
    assert paused(config)["wh"].by == "alice"
    at = paused(config)["wh"].at
    again = hw(config_file, "pipeline", "pause", "wh", "--by", "bob").output
    assert "paused already" in again and "by alice" in again
    assert paused(config)["wh"].at == at and paused(config)["wh"].by == "alice"
    assert json.loads(paused_path(config).read_text())["wh"]["by"] == "alice"

    for command in ("pause", "resume"):
        refused = hw(config_file, "pipeline", command, "nope", code=1).output
        assert "HW-CFG-001" in refused and "nope" in refused and "configured: pg, wh" in refused
    with pytest.raises(ConfigError, match="configured: pg, wh"):
        pause(config, "nope", by="test")
    assert set(paused(config)) == {"wh"}

    b = StatusBoard(config, [(d.id, d.mode) for d in config.pipeline.destinations])
    b.started("wh")
    b.failed("wh", Failure(code="HW-DST-002", reason="locked", transient=True), retry_in=2.0)
    b.paused("wh")
    b.started("pg")
    b.succeeded("pg", LastBatch(batch_id=3, committed_at=time.time(), duration_s=0.5, written=7))
    assert unhealthy(b.all()) == {}  # paused, even after a failure, is not failing

    text = hw(config_file, "pipeline", "status").output.splitlines()
    assert "paused" in text[0] and "last batch" in text[0]
    wh = next(line for line in text if line.startswith("wh "))
    pg = next(line for line in text if line.startswith("pg "))
    assert wh.split()[1] == "paused" and "by alice" in wh
    assert "#3: 7 rows" in pg and "by " not in pg
    rows = {
        r["destination"]: r
        for r in json.loads(hw(config_file, "pipeline", "status", "--format", "json").output)
    }
    assert rows["wh"]["state"] == "paused" and rows["wh"]["paused"]["by"] == "alice"
    assert rows["pg"]["paused"] is None and rows["pg"]["last_batch"]["batch_id"] == 3

    assert hw(config_file, "pipeline", "resume", "wh").output.strip() == "destination wh: resumed"
    assert paused(config) == {}
    assert hw(config_file, "pipeline", "resume", "wh").output.strip() == (
        "destination wh: not paused"
    )


def test_the_last_batch_reaches_the_file_within_about_a_second(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    b = StatusBoard(config, [("live", "stream")])
    b.started("live")

    def batch(n: int) -> LastBatch:
        return LastBatch(batch_id=n, committed_at=time.time(), duration_s=0.1, rows={"t": n})

    b.succeeded("live", batch(1))
    b.succeeded("live", batch(2))  # within the second: the board has it, the file not yet
    last = b.get("live").last_batch
    assert last is not None and last.batch_id == 2

    def file_has_2() -> bool:
        b.flush()  # what the supervisors do every half second
        on_file = in_file(config, "live").last_batch
        return on_file is not None and on_file.batch_id == 2

    wait_for(file_has_2, "the second batch in the file", timeout=5)
