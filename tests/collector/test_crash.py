"""Crash test of the collector (issue 3's proof): under load with ``ack: durable``, SIGKILL the
``headwater collector`` process at random moments. After each restart on the same log, every
event of every acked batch is on the log exactly as sent, nothing is stored twice, every stored
record is one that was sent, and appending still works.

Each round starts the collector (which recovers the log the previous round's kill left), checks
the log against everything acked so far, runs concurrent clients (Raccoon over WebSocket with
several requests in flight, Raccoon REST, Segment ``/v1/batch``) and kills the process after a
random number of acks plus a random jitter, while requests are in flight.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from headwater.bus import context
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.testing.collector import CollectorProcess
from headwater.testing.crash_load import WRITE_KEY, Ledger, Load

ROUNDS = 12
KILL_AFTER_ACKS = [0, 1, 5, 20, 60, 150, 300]  # batches acked in a round before its kill
KILL_WITHIN_S = (0.05, 1.0)  # ... or a random time into the round, whichever comes first
PROTOCOL_HEADER = {"ws": b"raccoon-ws", "rest": b"raccoon-rest", "segment": b"segment"}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        f"""\
data_dir: {tmp_path / "state"}
bus:
  embedded:
    durability: always
    segment_bytes: 262144  # small segments: kills also land around segment rolls
collector:
  ack: durable
  admission:
    min_free_disk_bytes: null
  sources:
    - id: crash-test
      write_keys: ["{hash_key(WRITE_KEY)}"]
"""
    )
    return path


@dataclass
class LogCheck:
    stored: int  # records on the log
    acked_events: int  # events of acked batches (all of them on the log)


def check_log(config_file: Path, ledger: Ledger) -> LogCheck:
    """Read the whole log (read-only, beside the running collector) and check it against what
    was sent and acked."""
    config = load_config(config_file, env={})
    seen: Counter[str] = Counter()
    with EmbeddedBus(config.log_dir(), config.bus.embedded, read_only=True) as bus:
        for info in bus.topics():
            for partition in range(info.partitions):
                low, high = bus.watermarks(info.name, partition)
                offset = low
                while offset < high:
                    records = bus.read(info.name, partition, offset, max_records=5000)
                    assert [r.offset for r in records] == list(
                        range(offset, offset + len(records))
                    ), f"{info.name}/{partition}: offsets are not contiguous from {offset}"
                    for r in records:
                        eid = check_record(ledger, r.value, dict(r.headers))
                        assert ledger.topic_of[eid] == info.name, f"{eid} is on {info.name}"
                        seen[eid] += 1
                    offset += len(records)
    twice = [eid for eid, n in seen.items() if n > 1]
    assert not twice, f"events stored more than once: {twice[:10]}"
    missing = [
        eid for bid in ledger.acked for eid in ledger.batches[bid].event_ids if eid not in seen
    ]
    assert not missing, f"{len(missing)} events of acked batches are missing: {missing[:10]}"
    acked_events = sum(len(ledger.batches[bid].event_ids) for bid in ledger.acked)
    return LogCheck(sum(seen.values()), acked_events)


def check_record(ledger: Ledger, value: bytes, headers: dict[str, bytes]) -> str:
    """The id of a stored event, after checking it is byte for byte one that was sent, with
    the context of the request that carried it."""
    prefix = b'{"id":"'
    assert value.startswith(prefix), f"a stored record was never sent: {value[:80]!r}"
    eid = value[len(prefix) : value.index(b'"', len(prefix))].decode()
    assert ledger.events.get(eid) == value, f"event {eid} is stored damaged: {value[:80]!r}"
    batch = ledger.batches[ledger.batch_of[eid]]
    assert headers[context.PROTOCOL] == PROTOCOL_HEADER[batch.protocol], eid
    if batch.protocol != "segment":
        assert headers[context.REQUEST_ID] == batch.id.encode(), eid
    assert len(headers[context.EVENT_ID]) == 36, eid
    return eid


def run_round(ledger: Ledger, port: int, round_no: int, collector: CollectorProcess) -> int:
    """Load until the collector is killed; how many batches were in flight at the kill."""
    kill_after = ledger.rng.choice(KILL_AFTER_ACKS)
    kill_within = ledger.rng.uniform(*KILL_WITHIN_S)
    load = Load(ledger, port, round_no, collector.kill, kill_after, kill_within)
    asyncio.run(load.run(ws_clients=2, rest_clients=1, segment_clients=2))
    return load.in_flight_at_kill


def final_appends(ledger: Ledger, port: int) -> None:
    """One more round that is not killed: a few batches by every client, all acked."""
    done: list[bool] = []
    load = Load(ledger, port, ROUNDS, lambda: done.append(True), kill_after_acks=40)
    before = len(ledger.acked)
    asyncio.run(load.run(ws_clients=1, rest_clients=1, segment_clients=1))
    assert done, "the final appends were not acked"
    assert len(ledger.acked) - before >= 40


@pytest.mark.slow
def test_acked_batches_survive_sigkill(config_file: Path, tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4))
    print(f"crash test seed {seed}")  # shown when the test fails
    ledger = Ledger(random.Random(seed))
    in_flight_at_kills = 0
    children: list[CollectorProcess] = []
    try:
        for round_no in range(ROUNDS):
            collector = CollectorProcess(config_file, tmp_path / f"collector-{round_no}.err")
            children.append(collector)
            port = collector.wait_healthy()
            check_log(config_file, ledger)  # what the previous round's kill left
            in_flight_at_kills += run_round(ledger, port, round_no, collector)
            assert collector.close() == -signal.SIGKILL
            assert "Traceback" not in collector.stderr(), collector.stderr()

        collector = CollectorProcess(config_file, tmp_path / "collector-final.err")
        children.append(collector)
        port = collector.wait_healthy()
        check = check_log(config_file, ledger)
        final_appends(ledger, port)
        after = check_log(config_file, ledger)
        assert after.stored > check.stored
        assert collector.stop() == 0, collector.stderr()
        collector.wait_for_line("headwater: stopped")
        assert "Traceback" not in collector.stderr(), collector.stderr()
    finally:
        for child in children:
            child.close()

    assert not ledger.anomalies, f"seed {seed}: {ledger.anomalies[:5]}"
    protocols = Counter(ledger.batches[b].protocol for b in ledger.acked)
    assert set(protocols) == {"ws", "rest", "segment"}, protocols
    assert check.acked_events > 2000, f"too little was acked to mean much: {check}"
    assert in_flight_at_kills > 0, "no kill landed while requests were in flight"
