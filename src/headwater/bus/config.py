"""Config of the bus (``bus``): which backend, and each backend's settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.kafka.config import KafkaBusConfig
from headwater.config.base import Section


class BusConfig(Section):
    backend: Literal["embedded", "kafka"] = Field(
        "embedded", description="embedded: the commit log on local disk; kafka: a Kafka cluster."
    )
    embedded: EmbeddedBusConfig = Field(
        default_factory=EmbeddedBusConfig, description="Settings of the embedded commit log."
    )
    kafka: KafkaBusConfig = Field(
        default_factory=KafkaBusConfig, description="Settings of the Kafka backend."
    )
