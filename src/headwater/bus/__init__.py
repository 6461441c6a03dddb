"""The log between collector and pipeline: ``open_bus(config)`` picks the backend by name."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from headwater.bus.base import Bus, Consumer
from headwater.bus.records import Message, Position, Record, TopicInfo, TopicPartition

if TYPE_CHECKING:
    from headwater.config.model import HeadwaterConfig

BACKENDS: dict[str, str] = {
    "embedded": "headwater.bus.embedded.backend:EmbeddedBus",
    "kafka": "headwater.bus.kafka.backend:KafkaBus",
}


def open_bus(config: HeadwaterConfig, *, read_only: bool = False) -> Bus:
    """Open the configured backend. ``read_only`` opens the embedded log without its write lock
    (for operator tools that only read while a server runs)."""
    module_name, _, cls_name = BACKENDS[config.bus.backend].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    bus: Bus = cls.from_config(config, read_only=read_only)
    return bus


__all__ = [
    "BACKENDS",
    "Bus",
    "Consumer",
    "Message",
    "Position",
    "Record",
    "TopicInfo",
    "TopicPartition",
    "open_bus",
]
