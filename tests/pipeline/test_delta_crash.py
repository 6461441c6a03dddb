"""Crash test of ``headwater up`` streaming into Delta Lake: under load (Raccoon over WebSocket
and REST, Segment ``/v1/batch``, ``ack: durable``), the whole process group (the Python
driver, the intake and Spark's JVM) is SIGKILLed 3 times at random moments, and started again
on the same data. After a last run that is stopped gracefully, every event of every acked batch
is in the Delta table exactly once, counted by event id through delta-rs, and nothing else is.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
import yaml

from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.destinations import open_destination
from headwater.testing.collector import CollectorProcess
from headwater.testing.crash_load import WRITE_KEY, Ledger, Load
from headwater.testing.waiting import wait_until
from headwater.testing.warehouse import delta_query

KILLS = 3
UP = ("up", "--port", "0", "--grpc-port", "0")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    config = {
        "data_dir": str(tmp_path / "state"),
        "bus": {"embedded": {"durability": "always"}},
        "collector": {
            "ack": "durable",
            "admission": {"min_free_disk_bytes": None},
            "sources": [{"id": "crash-test", "write_keys": [hash_key(WRITE_KEY)]}],
        },
        "pipeline": {
            "spark": {"master": "local[2]"},
            "destinations": [
                {
                    "id": "lake",
                    "type": "delta",
                    "path": str(tmp_path / "lake"),
                    "mode": "stream",
                    "trigger_interval_s": 0.5,
                    "table_name_template": "events",
                }
            ],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def landed(config_file: Path) -> Counter[str]:
    """How many rows of each event id the Delta table holds."""
    config = load_config(config_file)
    d = open_destination(config.pipeline.destinations[0], config.data_dir)
    try:
        if d.table("events") is None:
            return Counter()
        return Counter(str(r[0]) for r in delta_query(d, "SELECT id FROM events"))
    finally:
        d.close()


def acked_events(ledger: Ledger) -> set[str]:
    return {e for b in ledger.acked for e in ledger.batches[b].event_ids}


def test_headwater_up_killed_under_load_lands_every_acked_event_once_in_delta(
    tmp_path: Path,
) -> None:
    seed = int.from_bytes(os.urandom(4))
    print(f"crash test seed {seed}")  # shown when the test fails
    ledger = Ledger(random.Random(seed))
    config_file = write_config(tmp_path)
    children: list[CollectorProcess] = []
    try:
        for round_no in range(KILLS):
            up = CollectorProcess(config_file, tmp_path / f"up-{round_no}.err", UP, group=True)
            children.append(up)
            port = up.wait_healthy()
            up.wait_for_line("headwater: ready")
            seconds = ledger.rng.uniform(3.0, 8.0)  # the pipeline writes meanwhile
            load = Load(ledger, port, round_no, up.kill, 10**9, seconds)
            asyncio.run(load.run(ws_clients=2, rest_clients=1, segment_clients=2))
            assert up.close() == -signal.SIGKILL
            counts = landed(config_file)
            assert max(counts.values(), default=1) == 1, f"seed {seed}: a row twice after a kill"

        up = CollectorProcess(config_file, tmp_path / "up-final.err", UP, group=True)
        children.append(up)
        port = up.wait_healthy()
        up.wait_for_line("headwater: ready")
        done: list[bool] = []
        load = Load(ledger, port, KILLS, lambda: done.append(True), kill_after_acks=40)
        asyncio.run(load.run(ws_clients=1, rest_clients=1, segment_clients=1))
        assert done, "the last round's batches were not acked"
        acked = acked_events(ledger)
        try:
            wait_until(lambda: acked <= set(landed(config_file)), "every acked event in Delta", 300)
        except AssertionError as e:
            missing = len(acked - set(landed(config_file)))
            raise AssertionError(
                f"seed {seed}: {e} ({missing} of {len(acked)} missing); the last run said:\n"
                + up.stderr()[-4000:]
            ) from None
        assert up.stop() == 0, up.stderr()
        assert "Traceback" not in up.stderr(), up.stderr()
    finally:
        for child in children:
            child.close()

    counts = landed(config_file)
    assert max(counts.values()) == 1, f"seed {seed}: rows twice"
    assert acked <= set(counts), f"seed {seed}: {len(acked - set(counts))} acked events missing"
    assert set(counts) <= set(ledger.events), "a row of an event that was never sent"
    assert not ledger.anomalies, f"seed {seed}: {ledger.anomalies[:5]}"
    assert len(acked) > 1000, f"too little was acked to mean much: {len(acked)}"
