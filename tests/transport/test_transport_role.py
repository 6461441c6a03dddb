"""``headwater transport`` as a process on the embedded log, with a PostgreSQL reader: /healthz,
``transport status``, SIGTERM keeps everything read, and SIGKILLs at random moments while rows
change lose nothing: for every row, the last message on the log is the row's last state."""

from __future__ import annotations

import json
import random
import threading
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
    slot_of,
    wait_caught_up,
    wait_until,
)

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.cli.main import cli
from headwater.testing.collector import CollectorProcess
from headwater.transport.message import Op

pytestmark = pytest.mark.slow
ROLE = ("transport", "--port", "0")


def write_config(tmp_path: Path, dsn: str) -> Path:
    doc = {
        "data_dir": str(tmp_path / "data"),
        "transport": {
            "readers": [
                reader_config(dsn, tables=["t"], partitions=1, heartbeat_s=1).model_dump(
                    mode="json"
                )
            ]
        },
    }
    path = tmp_path / "headwater.yaml"
    path.write_text(json.dumps(doc))
    return path


def last_states(log_dir: Path) -> dict[int, Any]:
    """Each row's last state as the log tells it (None: deleted)."""
    bus = EmbeddedBus(log_dir, read_only=True)
    try:
        out: dict[int, Any] = {}
        for c, _ in messages(bus):
            if c.op in (Op.READ, Op.INSERT, Op.UPDATE) and c.data:
                out[c.data["id"]] = c.data["v"]
            elif c.op == Op.DELETE and c.key:
                out[c.key["id"]] = None
        return out
    finally:
        bus.close()


def test_role_status_and_sigterm(dsn: str, tmp_path: Path) -> None:
    execute(dsn, "create table t (id int primary key, v int)", "insert into t values (1, 1)")
    config = write_config(tmp_path, dsn)
    p = CollectorProcess(config, tmp_path / "role.log", ROLE)
    try:
        p.wait_healthy()
        status_file = tmp_path / "data" / "transport" / "src" / "status.json"
        wait_until("streaming", lambda: '"phase": "sync"' in _text(status_file))
        execute(dsn, "insert into t values (2, 2)")
        wait_until("the insert acknowledged", lambda: '"changes": 1' in _text(status_file))
        assert p.stop() == 0
    finally:
        p.close()
    assert last_states(tmp_path / "data" / "log") == {1: 1, 2: 2}
    result = CliRunner().invoke(cli, ["transport", "status", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "src" in result.output and ".public.t  sync" in result.output.replace("   ", "  ")
    result = CliRunner().invoke(
        cli, ["transport", "status", "--format", "json", "--config", str(config)]
    )
    body = json.loads(result.output)
    assert body["id"] == "src" and body["running"] is False and body["position"]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_sigkills_lose_nothing(dsn: str, tmp_path: Path) -> None:
    execute(
        dsn,
        "create table t (id int primary key, v int)",
        "insert into t select g, 0 from generate_series(1, 2000) g",
    )
    config = write_config(tmp_path, dsn)
    stop = threading.Event()
    rng = random.Random(12)

    def change() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            n = 0
            while not stop.is_set():
                i = rng.randint(1, 2500)
                if n % 7 == 0:
                    c.execute("delete from t where id = %s", (i,))
                else:
                    c.execute(
                        "insert into t values (%s, %s) on conflict (id) do update set v = %s",
                        (i, n, n),
                    )
                n += 1

    writer = threading.Thread(target=change, daemon=True)
    writer.start()
    try:
        for kill in range(5):
            p = CollectorProcess(config, tmp_path / f"role-{kill}.log", ROLE)
            try:
                p.wait_healthy()
                stop.wait(rng.uniform(0.5, 2.5))  # a random moment (stop is not set here)
                p.kill()
            finally:
                p.close()
    finally:
        stop.set()
        writer.join(10)
    p = CollectorProcess(config, tmp_path / "role-last.log", ROLE)
    try:
        p.wait_healthy()
        with psycopg.connect(dsn) as c:
            source = dict(c.execute("select id, v from t").fetchall())
        wait_caught_up(dsn, slot_of(dsn), timeout=120)
        assert p.stop() == 0
    finally:
        p.close()
    states = {k: v for k, v in last_states(tmp_path / "data" / "log").items() if v is not None}
    assert states == source


def test_up_runs_the_readers_and_the_mirror(dsn: str, tmp_path: Path) -> None:
    """One command on one machine: `headwater up` reads the table and mirrors it."""
    execute(dsn, "create table t (id int primary key, v int)", "insert into t values (1, 1)")
    config = json.loads(write_config(tmp_path, dsn).read_text())
    mirror = tmp_path / "mirror.duckdb"
    config["pipeline"] = {
        "destinations": [
            {
                "id": "mirror",
                "type": "duckdb",
                "path": str(mirror),
                "apply": "upsert",
                "mode": "stream",
                "trigger_interval_s": 0.5,
            }
        ]
    }
    path = tmp_path / "headwater.yaml"
    path.write_text(json.dumps(config))
    up = CollectorProcess(path, tmp_path / "up.log", ("up", "--port", "0", "--grpc-port", "0"))
    try:
        up.wait_healthy()
        up.wait_for_line("headwater: transport readers running (src)")
        up.wait_for_line("headwater: ready")
        execute(dsn, "insert into t values (2, 2)", "update t set v = 10 where id = 1")

        def mirrored() -> Any:
            try:
                with duckdb.connect(str(mirror), read_only=True) as c:
                    return c.execute("select * from t order by id").fetchall() == [(1, 10), (2, 2)]
            except duckdb.Error:  # not made yet, or being written
                return False

        wait_until("the mirror", mirrored, timeout=120)
        assert up.stop() == 0
    finally:
        up.close()
