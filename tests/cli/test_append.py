"""``headwater log append`` on inputs larger than the log's write queue, and stopped part-way.

The log's queue is made tiny (``max_pending_bytes``) so that the appends meet its backpressure
at once. The interrupted appends run the real command in a child process and send it a real
signal; the topic is then read back whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from headwater.bus import open_bus
from headwater.cli.main import cli
from headwater.config import load_config

pytestmark = pytest.mark.usefixtures("no_headwater_env")

HEADWATER = Path(sys.executable).with_name("headwater")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        "data_dir: state\n"
        "bus:\n"
        "  embedded:\n"
        "    durability: always\n"
        "    default_partitions: 3\n"
        "    max_pending_bytes: 8192\n"
    )
    return path


def numbered(first: int, last: int) -> bytes:
    """Lines ``first..last`` (1-based), each naming its own number."""
    return b"".join(b'{"n": %d, "page": "/p/%d"}\n' % (n, n % 97) for n in range(first, last + 1))


def numbers_in_topic(config_file: Path, topic: str) -> Counter[int]:
    """How many times each line number is in ``topic`` (read-only: a writer may hold the log)."""
    seen: Counter[int] = Counter()
    with open_bus(load_config(config_file, env={}), read_only=True) as bus:
        if topic not in {t.name for t in bus.topics()}:
            return seen
        for p in range(bus.topic(topic).partitions):
            low, high = bus.watermarks(topic, p)
            offset = low
            while offset < high:
                records = bus.read(topic, p, offset, max_records=5000)
                seen.update(json.loads(r.value)["n"] for r in records)
                offset = records[-1].offset + 1
    return seen


def wait_for_records(
    config_file: Path, topic: str, at_least: int, proc: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + 60
    while sum(numbers_in_topic(config_file, topic).values()) < at_least:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"fewer than {at_least} records in time"
        time.sleep(0.05)  # polling the log from outside: nothing to wait on across processes


def start_append(config_file: Path, topic: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(HEADWATER),
            "--config",
            str(config_file),
            "log",
            "append",
            topic,
            "--format",
            "json",
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")},
    )


def test_an_input_far_larger_than_the_queue_is_appended_whole(config_file: Path) -> None:
    """200,000 lines through an 8 KiB write queue, in one command: every line exactly once."""
    total = 200_000
    result = CliRunner().invoke(
        cli,
        ["--config", str(config_file), "log", "append", "clicks", "--format", "json"],
        input=numbered(1, total),
    )
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["appended"] == total and report["durable_lines"] == total
    assert "stopped" not in report
    seen = numbers_in_topic(config_file, "clicks")
    assert seen == Counter(range(1, total + 1))


def test_bad_lines_stop_the_append_after_the_batches_before_them(config_file: Path) -> None:
    """Bad lines in the third batch: the two batches before them are appended, and the
    report says to resume at the third batch's first line."""
    text = numbered(1, 2500) + b"not json\n" + numbered(2502, 2600)
    result = CliRunner().invoke(
        cli, ["--config", str(config_file), "log", "append", "clicks"], input=text
    )
    assert result.exit_code == 1
    assert "line 2501: invalid JSON" in result.stderr
    assert (
        "error: HW-OPS-001: 1 bad line on stdin; the first 2000 lines are durable; "
        "resume with `tail -n +2001` once they are fixed"
    ) in result.stderr
    assert numbers_in_topic(config_file, "clicks") == Counter(range(1, 2001))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_append_reports_exactly_the_durable_prefix(
    config_file: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    """Interrupted mid-append, the command reports N; the topic then holds lines 1..N, each
    once, and nothing else; appending ``tail -n +N+1`` of the input then completes it."""
    total = 400_000
    events = tmp_path / "events.jsonl"
    events.write_bytes(numbered(1, total))
    proc = start_append(config_file, "clicks", "--input", str(events))
    wait_for_records(config_file, "clicks", 20_000, proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    report = json.loads(out)
    durable = report["durable_lines"]
    assert report["stopped"] == signum.name and report["resume_line"] == durable + 1
    assert 20_000 <= durable < total, "the signal came after the append ended"
    assert report["appended"] == durable
    assert numbers_in_topic(config_file, "clicks") == Counter(range(1, durable + 1))

    rest = subprocess.run(
        ["tail", "-n", f"+{durable + 1}", str(events)], capture_output=True, check=True
    ).stdout
    result = CliRunner().invoke(
        cli, ["--config", str(config_file), "log", "append", "clicks"], input=rest
    )
    assert result.exit_code == 0, result.output
    assert numbers_in_topic(config_file, "clicks") == Counter(range(1, total + 1))


def test_stdin_is_appended_as_it_arrives_and_a_signal_while_waiting_for_more_stops(
    config_file: Path,
) -> None:
    """The command appends what it has read without waiting for the end of its input, and a
    Ctrl-C while it waits for more input reports what is durable."""
    proc = start_append(config_file, "clicks")
    assert proc.stdin is not None
    proc.stdin.write(numbered(1, 5000))
    proc.stdin.flush()
    wait_for_records(config_file, "clicks", 5000, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    report = json.loads(out)
    assert (report["durable_lines"], report["resume_line"]) == (5000, 5001)
    assert numbers_in_topic(config_file, "clicks") == Counter(range(1, 5001))


def test_the_text_report_says_where_to_resume(config_file: Path, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_bytes(numbered(1, 400_000))
    proc = subprocess.Popen(
        [
            str(HEADWATER),
            "--config",
            str(config_file),
            "log",
            "append",
            "clicks",
            "-i",
            str(events),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_records(config_file, "clicks", 10_000, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    durable = sum(numbers_in_topic(config_file, "clicks").values())
    assert proc.returncode == 130
    assert f"appended {durable} records to clicks" in out.decode()
    assert (
        f"stopped (SIGINT): the first {durable} lines are durable; "
        f"resume with `tail -n +{durable + 1}`"
    ) in err.decode()
