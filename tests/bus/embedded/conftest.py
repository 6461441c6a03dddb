from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig

OpenLog = Callable[..., EmbeddedBus]
FlipByte = Callable[[Path, int], None]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def open_log(tmp_path: Path) -> Iterator[OpenLog]:
    """Open (and at the end close) embedded logs under one directory."""
    opened: list[EmbeddedBus] = []

    def _open(read_only: bool = False, **config: object) -> EmbeddedBus:
        bus = EmbeddedBus(tmp_path / "log", EmbeddedBusConfig(**config), read_only=read_only)
        opened.append(bus)
        return bus

    yield _open
    for bus in opened:
        bus.close()


@pytest.fixture
def flip_byte() -> FlipByte:
    """Damage a log file as a bad disk would: one bit of the byte at ``offset`` flipped."""

    def _flip(path: Path, offset: int) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))

    return _flip
