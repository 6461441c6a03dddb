"""Fixtures shared by the collector's tests: an embedded log of one partition per topic, and a
collector on default settings serving it (a test module with its own settings overrides
``server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.testing.collector import RunningCollector, running_collector


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    with EmbeddedBus(tmp_path / "log", EmbeddedBusConfig(default_partitions=1)) as b:
        yield b


@pytest.fixture
def server(bus: EmbeddedBus) -> Iterator[RunningCollector]:
    with running_collector(bus) as running:
        yield running
