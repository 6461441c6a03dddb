"""The ``bus`` fixture: every contract test runs once per backend.

The Kafka backend runs against the session's Apache Kafka broker (the ``kafka_broker``
fixture of the ``headwater.testing.fixtures`` plugin). Tests share that broker, so every test
names its topics and groups with ``unique``.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from headwater.bus import Bus, open_bus
from headwater.config.model import HeadwaterConfig

BACKENDS = [
    pytest.param("embedded", id="embedded"),
    pytest.param("kafka", id="kafka", marks=pytest.mark.kafka),
]

# Kafka's smallest session timeout (group.min.session.timeout.ms): a lost member is noticed fast.
KAFKA_TEST_CLIENT: dict[str, Any] = {"consumer": {"session.timeout.ms": 6000}, "timeout_s": 15.0}


def make_config(
    backend: str, data_dir: Path, request: pytest.FixtureRequest, **bus: Any
) -> HeadwaterConfig:
    """A config for ``backend``; ``bus`` adds settings of that backend's section."""
    if backend == "embedded":
        try:
            importlib.import_module("headwater.bus.embedded.backend")
        except ImportError as exc:
            pytest.skip(f"the embedded backend cannot be imported yet: {exc}")
        return HeadwaterConfig.model_validate(
            {"data_dir": data_dir, "bus": {"backend": "embedded", "embedded": bus}}
        )
    broker = request.getfixturevalue("kafka_broker")
    kafka = {**KAFKA_TEST_CLIENT, "bootstrap_servers": broker.bootstrap_servers, **bus}
    return HeadwaterConfig.model_validate(
        {"data_dir": data_dir, "bus": {"backend": "kafka", "kafka": kafka}}
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def bus_config(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> HeadwaterConfig:
    return make_config(backend, tmp_path, request)


@pytest.fixture
def open_buses(bus_config: HeadwaterConfig) -> Iterator[Callable[..., Bus]]:
    """Open a bus of the test's backend (again, to test resuming); all are closed at the end.
    Other keyword arguments than ``read_only`` override settings of the backend's section."""
    opened: list[Bus] = []

    def open_(*, read_only: bool = False, **overrides: Any) -> Bus:
        config = bus_config
        if overrides:
            section = bus_config.bus.backend
            data = bus_config.model_dump()
            data["bus"][section].update(overrides)
            config = HeadwaterConfig.model_validate(data)
        bus = open_bus(config, read_only=read_only)
        opened.append(bus)
        return bus

    yield open_
    for bus in reversed(opened):
        bus.close()


@pytest.fixture
def bus(open_buses: Callable[..., Bus]) -> Bus:
    return open_buses()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Names that no other test on the shared broker uses."""
    suffix = uuid.uuid4().hex[:10]
    return lambda base: f"{base}-{suffix}"
