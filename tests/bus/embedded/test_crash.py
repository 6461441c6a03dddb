"""Crash test: SIGKILL an appending process at random moments; every acked record survives
byte-identical, nothing past a torn tail is returned, and appending continues."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.records import Message

sys.path.insert(0, str(Path(__file__).parent))
from crash_appender import CONFIG, record_id, value_for

CHILD = Path(__file__).with_name("crash_appender.py")
KILLS = 20


def _run_and_kill(directory: Path, run: int, rng: random.Random) -> list[tuple[int, int, bytes]]:
    """Start the appender, SIGKILL it after a random number of acks; return what it acked."""
    want = rng.choice([0, 1, 10, 100, 500, 1000, 2000, 4000])
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), str(run)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert child.stdout is not None
    read: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(read) < want and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        read.append(line)
    child.send_signal(signal.SIGKILL)
    rest, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    lines = (b"".join(read) + rest).split(b"\n")[:-1]  # the last piece may be a partial line
    out = []
    for line in lines:
        run_, thread, seq, index, partition, offset = line.split()
        rid = record_id(int(run_), int(thread), int(seq), int(index))
        out.append((int(partition), int(offset), rid))
    return out


def test_acked_records_survive_sigkill(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    rng = random.Random(2026)
    acked: dict[tuple[int, int], bytes] = {}
    for run in range(KILLS):
        for partition, offset, rid in _run_and_kill(directory, run, rng):
            acked[(partition, offset)] = rid
        with EmbeddedBus(directory, CONFIG) as bus:
            seen = 0
            for partition in range(2):
                low, high = bus.watermarks("t", partition) if bus.topics() else (0, 0)
                records = bus.read("t", partition, low, max_records=10**7) if high else []
                assert [r.offset for r in records] == list(range(low, high))
                for r in records:
                    rid = dict(r.headers)["id"]
                    assert r.value == value_for(rid), f"record {partition}/{r.offset} is damaged"
                    if (partition, r.offset) in acked:
                        assert acked[(partition, r.offset)] == rid
                        seen += 1
            assert seen == len(acked), f"run {run}: {len(acked) - seen} acked records are missing"
            if bus.topics():
                probe = Message(value_for(b"p"), headers=(("id", b"p"),))
                (pos,) = bus.append("t", [probe]).result(timeout=30)
                assert bus.read("t", pos.partition, pos.offset)[0].value == value_for(b"p")
    assert len(acked) > 1000, "the child acked too little for the test to mean much"
