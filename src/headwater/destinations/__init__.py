"""Writers into warehouses and files: ``open_destination(config)`` picks one by type."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from headwater.destinations.base import Column, Destination, TableSchema
from headwater.destinations.types import ColumnType

if TYPE_CHECKING:
    from headwater.pipeline.config import DestinationConfig

# type -> "module:factory"; each factory is ``open(config, data_dir) -> Destination``.
DESTINATIONS: dict[str, str] = {
    "duckdb": "headwater.destinations.duckdb.client:open_destination",
    "postgres": "headwater.destinations.postgres.client:open_destination",
    "clickhouse": "headwater.destinations.clickhouse.client:open_destination",
    "files": "headwater.destinations.files.client:open_destination",
    "delta": "headwater.destinations.delta.client:open_destination",
    "http": "headwater.delivery.destination:open_destination",
}


def open_destination(config: DestinationConfig, data_dir: Path) -> Destination:
    """Connect to the configured destination (imports its optional dependencies lazily)."""
    target = DESTINATIONS.get(config.type)
    if target is None:
        from headwater.destinations.base import DestinationError

        raise DestinationError(
            f"destination {config.id!r}: type {config.type!r} has a dialect but no loader here"
        )
    module_name, _, name = target.partition(":")
    factory = getattr(importlib.import_module(module_name), name)
    destination: Destination = factory(config, data_dir)
    return destination


__all__ = ["DESTINATIONS", "Column", "ColumnType", "Destination", "TableSchema", "open_destination"]
