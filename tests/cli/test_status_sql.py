"""``headwater pipeline status``, ``/readyz`` naming failing destinations, and ``headwater sql``
reading the DuckDB warehouse without holding it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner, Result

from headwater.bus import open_bus
from headwater.cli.main import cli
from headwater.config import load_config
from headwater.ops import warehouse
from headwater.pipeline.status import Failure, StatusBoard, unhealthy
from headwater.testing.collector import running_collector

pytestmark = pytest.mark.usefixtures("no_headwater_env")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "bus:\n"
        "  embedded:\n"
        "    durability: never\n"
        "pipeline:\n"
        "  destinations:\n"
        "    - {id: wh, type: duckdb, mode: stream}\n"
        "    - {id: pg, type: postgres, dsn: 'postgresql://x@127.0.0.1:1/x', mode: batch}\n"
    )
    return path


def hw(config_file: Path, *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(cli, [*args, "--config", str(config_file)])
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def board(config_file: Path) -> StatusBoard:
    config = load_config(config_file)
    return StatusBoard(config, [(d.id, d.mode) for d in config.pipeline.destinations])


def test_status_before_any_pipeline_ran(config_file: Path) -> None:
    assert "no pipeline status yet" in hw(config_file, "pipeline", "status").output
    assert json.loads(hw(config_file, "pipeline", "status", "--format", "json").output) == []


def test_status_names_the_failing_destination_and_why(config_file: Path) -> None:
    b = board(config_file)
    b.started("wh")
    b.succeeded("wh")
    b.started("pg")
    lock = Failure(code="HW-DST-002", reason="warehouse.duckdb is locked", transient=True)
    b.failed("pg", lock, retry_in=2.0)

    text = hw(config_file, "pipeline", "status").output.splitlines()
    assert text[0].split()[:3] == ["destination", "state", "last"]
    wh = next(line for line in text if line.startswith("wh "))
    pg = next(line for line in text if line.startswith("pg "))
    assert "running" in wh and "HW-DST" not in wh
    assert "retrying" in pg and "HW-DST-002: warehouse.duckdb is locked" in pg

    rows = {
        r["destination"]: r
        for r in json.loads(hw(config_file, "pipeline", "status", "--format", "json").output)
    }
    assert rows["wh"]["state"] == "running" and rows["wh"]["seconds_since_success"] < 60
    assert rows["pg"]["consecutive_failures"] == 1 and rows["pg"]["attempts"] == 1
    assert rows["pg"]["last_error_code"] == "HW-DST-002"
    assert rows["pg"]["seconds_since_success"] is None

    b.started("pg")
    b.succeeded("pg")
    assert unhealthy(b.all()) == {}


def test_pipeline_keeps_its_options_and_gains_status(config_file: Path) -> None:
    out = hw(config_file, "pipeline", "--help").output
    assert "--once" in out and "status" in out
    assert "--format" in hw(config_file, "pipeline", "status", "--help").output


def test_readyz_names_each_failing_destination(config_file: Path) -> None:
    config = load_config(config_file)
    b = board(config_file)
    with closing(open_bus(config)) as bus, running_collector(bus, config.collector) as server:
        server.collector.readiness = lambda: unhealthy(b.all())
        with urllib.request.urlopen(f"{server.url}/readyz", timeout=5) as ok:
            assert ok.status == 200
        b.failed("pg", Failure(code=None, reason="connection refused", transient=True), 1.0)
        with pytest.raises(urllib.error.HTTPError) as failing:
            urllib.request.urlopen(f"{server.url}/readyz", timeout=5)
        assert failing.value.code == 503
        body = json.loads(failing.value.read())
        assert body == {"ready": False, "failing": {"pg": "retrying: connection refused"}}
        with urllib.request.urlopen(f"{server.url}/healthz", timeout=5) as live:
            assert live.status == 200  # liveness is not readiness


def make_warehouse(config_file: Path) -> Path:
    path = load_config(config_file).warehouse_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(duckdb.connect(str(path))) as c:
        c.execute("create table events as select range as n, 'u' || range as who from range(3)")
    return path


def test_sql_prints_rows_as_a_table_or_json(config_file: Path) -> None:
    make_warehouse(config_file)
    lines = hw(config_file, "sql", "select n, who from events order by n").output.splitlines()
    assert lines[0].split() == ["n", "who"] and lines[1].split() == ["0", "u0"]
    out = hw(config_file, "sql", "select n, who from events order by n", "--format", "json")
    assert [json.loads(x) for x in out.output.splitlines()] == [
        {"n": i, "who": f"u{i}"} for i in range(3)
    ]


def hold_for_writing(path: Path, seconds: float) -> subprocess.Popen[bytes]:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import duckdb, sys, time\n"
            "c = duckdb.connect(sys.argv[1])\n"
            "print('held', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n",
            str(path),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    holder.stdout.close()
    return holder


def test_sql_waits_briefly_for_the_writer_and_never_holds_the_file(config_file: Path) -> None:
    path = make_warehouse(config_file)
    holder = hold_for_writing(path, 1.5)  # a writer mid-batch
    try:
        out = hw(config_file, "sql", "select count(*) as c from events", "--format", "json")
        assert json.loads(out.output) == {"c": 3}
        assert holder.wait(timeout=10) == 0
    finally:
        holder.kill()
    # the file is free again as soon as the command returns: a writer can open it at once
    with closing(duckdb.connect(str(path))) as c:
        c.execute("insert into events values (3, 'u3')")


def test_sql_gives_up_with_a_code_when_the_file_stays_locked(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_warehouse(config_file)
    monkeypatch.setattr(warehouse, "LOCK_WAIT_S", 0.5)
    holder = hold_for_writing(path, 30)
    try:
        result = hw(config_file, "sql", "select 1", code=1)
        assert "HW-SQL-001" in result.output
    finally:
        holder.kill()
        holder.wait()
