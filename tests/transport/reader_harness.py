"""What the files and Kafka reader tests share: the embedded log they write to, a reader on a
thread, a reader that dies between its durable append and its state save, and a reader in a
child process to SIGKILL (a small script, or ``headwater transport``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.records import Record
from headwater.transport.config import ReaderBase
from headwater.transport.reader import Reader

BUS_CONFIG = EmbeddedBusConfig(default_partitions=2)
DEADLINE_S = 60.0

# The child of the SIGKILL tests: opens the log at argv[1] and runs the reader of argv[3] (JSON)
# with its state in argv[2] until it is killed.
CHILD = """
import sys, threading
from pathlib import Path
import orjson
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.transport.config import TransportConfig
from headwater.transport.reader import reader_class
config = TransportConfig.model_validate({"readers": [orjson.loads(sys.argv[3])]}).readers[0]
bus = EmbeddedBus(Path(sys.argv[1]), EmbeddedBusConfig(default_partitions=2))
reader_class(config.type)(config, bus, Path(sys.argv[2])).run(threading.Event())
"""
LAUNCHERS = [pytest.param("script", id="script"), pytest.param("role", id="headwater-transport")]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def read_all(bus: EmbeddedBus, topic: str, partition: int) -> list[Record]:
    low, high = bus.watermarks(topic, partition)
    out: list[Record] = []
    while low < high:
        batch = bus.read(topic, partition, low, max_records=high - low)
        out.extend(batch)
        low = batch[-1].offset + 1
    return out


class Running:
    """A reader running on a thread; ``stop`` ends it and re-raises what it raised."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.reader.run(self._stop)
        except BaseException as e:
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the reader did not stop"
        if self.error is not None:
            raise self.error


class Killed(Exception):
    """Stands for a SIGKILL between a durable append and the save of the state."""


def dies_on_save(reader: Reader, saves: int) -> None:
    """Make ``reader`` die at its state save number ``saves + 1``, after the append it was to
    record."""
    count = 0
    save = reader.save_state

    def save_state(body: dict[str, Any]) -> None:
        nonlocal count
        count += 1
        if count > saves:
            raise Killed
        save(body)

    reader.save_state = save_state  # type: ignore[method-assign]


def start_child(launcher: str, data: Path, config: ReaderBase) -> subprocess.Popen[bytes]:
    """The reader in a process of its own: a small script, or ``headwater transport``."""
    if launcher == "script":
        args = ["-c", CHILD, str(data / "log"), str(data / "transport" / config.id)]
        args.append(config.model_dump_json())
    else:
        body = {
            "data_dir": str(data),
            "bus": {"backend": "embedded", "embedded": {"default_partitions": 2}},
            "transport": {"port": 0, "readers": [orjson.loads(config.model_dump_json())]},
        }
        (data.parent / "headwater.yaml").write_bytes(orjson.dumps(body))
        args = ["-m", "headwater", "transport", "--config", str(data.parent / "headwater.yaml")]
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def kill(child: subprocess.Popen[bytes]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(DEADLINE_S)
    assert child.returncode == -signal.SIGKILL
