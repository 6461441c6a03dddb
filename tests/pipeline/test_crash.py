"""Crash test: ``headwater pipeline`` (stream mode, small micro-batches, DuckDB) is SIGKILLed at
random points while it writes, at least 10 times, and restarted on the same checkpoint; after
each kill the warehouse holds no event twice, and once it has caught up it holds every event
exactly once. The same, 3 kills, with a Python function making three events of each, and into
Delta tables on the S3 server (counted by event id through delta-rs; Delta on a local folder
is killed under load in tests/pipeline/test_delta_crash.py).

The whole process group is killed (the Python driver and Spark's JVM), as a power cut would.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import IO, Any

import duckdb
import pytest
import yaml

from headwater.bus import context, open_bus
from headwater.bus.records import Message
from headwater.config.loader import load_config
from headwater.config.model import HeadwaterConfig
from headwater.destinations import open_destination
from headwater.testing.warehouse import delta_query

FIRST = 1200  # events on the log before the first start
PER_ROUND = 300  # events added before each restart, so that every run has batches to write
KILLS = 10
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


FANOUT = """\
def triple(event):
    return [dict(event, part=k) for k in range(3)]
"""


def write_config(tmp_path: Path, fan_out: bool = False, kind: str = "duckdb", **dest: Any) -> Path:
    path = tmp_path / "headwater.yaml"
    functions = []
    if fan_out:  # a module beside the config, as a user keeps one
        (tmp_path / "fan_out.py").write_text(FANOUT)
        functions = [{"name": "python", "function": "fan_out:triple"}]
    config = {
        "data_dir": str(tmp_path / "data"),
        "bus": {"embedded": {"default_partitions": 2}},
        "pipeline": {
            "spark": {"master": "local[2]"},
            "destinations": [
                {
                    "id": "wh",
                    "type": kind,
                    "mode": "stream",
                    "trigger_interval_s": 0,
                    "max_records_per_trigger": 300,
                    "functions": functions,
                    **dest,
                }
            ],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def fill_log(config: HeadwaterConfig, start: int, count: int) -> None:
    with closing(open_bus(config)) as bus:
        messages = [
            Message(
                json.dumps({"n": i, "user": f"u{i % 7}", "props": {"v": i * 0.5}}).encode(),
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


def pipeline(config_file: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "headwater", "--config", str(config_file), "pipeline", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def pump(stream: IO[bytes], lines: queue.Queue[bytes]) -> None:
    with stream:
        for line in stream:
            lines.put(line)


def kill_while_writing(config_file: Path, rng: random.Random) -> None:
    """Start the pipeline, wait until it has written a micro-batch, then kill it after a random
    delay (so the kill lands anywhere in the batches that follow)."""
    child = pipeline(config_file)
    assert child.stderr is not None
    lines: queue.Queue[bytes] = queue.Queue()
    threading.Thread(target=pump, args=(child.stderr, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while b"destination wh batch" not in lines.get(timeout=max(deadline - time.monotonic(), 0)):
            pass
        time.sleep(rng.uniform(0, 2.5))  # where the kill lands, not synchronisation
    except queue.Empty:
        raise AssertionError(f"no micro-batch within 120 s (exit code {child.poll()})") from None
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)


def counts(config: HeadwaterConfig) -> tuple[int, int]:
    sql = "select count(*), count(distinct eventn_ctx_event_id) from events"
    dest = config.pipeline.destinations[0]
    if dest.type == "delta":
        d = open_destination(dest, config.data_dir)
        try:
            if d.table("events") is None:
                return 0, 0
            ((n, distinct),) = delta_query(d, sql)
        finally:
            d.close()
        return int(n), int(distinct)
    with closing(duckdb.connect(str(config.warehouse_path()), read_only=True)) as c:
        (row,) = c.execute(
            "select count(*), count(distinct eventn_ctx_event_id) from events"
        ).fetchall()
    return int(row[0]), int(row[1])


@pytest.mark.parametrize(
    ("fan_out", "kills", "kind"),
    [(False, KILLS, "duckdb"), (True, 3, "duckdb"), (False, 3, "delta-s3")],
    ids=["plain", "fan-out", "delta-s3"],
)
def test_sigkilled_pipeline_writes_each_event_exactly_once(
    request: pytest.FixtureRequest, tmp_path: Path, fan_out: bool, kills: int, kind: str
) -> None:
    """With fan_out, a Python function makes three events of each: each of those once too.
    delta-s3: the Delta tables on the S3 server (SeaweedFS, headwater.testing.s3)."""
    dest: dict[str, Any] = {}
    if kind == "delta-s3":
        s3 = request.getfixturevalue("s3_server")
        bucket = s3.create_bucket(f"crash-{uuid.uuid4().hex[:12]}")
        dest = {"path": f"s3a://{bucket}/lake", "options": {"storage_options": s3.storage_options}}
        kind = "delta"
    config_file = write_config(tmp_path, fan_out, kind, **dest)
    config = load_config(config_file)
    fill_log(config, 0, FIRST)
    total = FIRST
    rng = random.Random(4)
    progress = []
    for _ in range(kills):
        kill_while_writing(config_file, rng)
        rows, distinct = counts(config)
        assert rows == distinct, f"{rows - distinct} duplicate rows after a kill"
        progress.append(rows)
        fill_log(config, total, PER_ROUND)
        total += PER_ROUND
    assert progress[-1] > progress[0], "the pipeline made no progress across restarts"

    done = pipeline(config_file, "--once")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err.decode()[-3000:]
    made = 3 * total if fan_out else total
    assert counts(config) == (made, made)
