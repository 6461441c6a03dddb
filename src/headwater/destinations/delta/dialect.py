"""Delta Lake: Spark SQL's type names, lower-case identifiers (Spark resolves names without case,
and delta-rs compares them exactly, so one spelling per column is kept)."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class DeltaDialect(Dialect):
    name = "delta"
    max_identifier_length = 255
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "boolean",
        ColumnType.INT64: "long",
        ColumnType.FLOAT64: "double",
        ColumnType.TIMESTAMP: "timestamp",
        ColumnType.STRING: "string",
    }

    def extra_types(self) -> dict[str, ColumnType]:
        """The other primitive types a Delta table written by someone else may have."""
        return {
            "bigint": ColumnType.INT64,
            "integer": ColumnType.INT64,
            "short": ColumnType.INT64,
            "byte": ColumnType.INT64,
            "float": ColumnType.FLOAT64,
            "timestamp_ntz": ColumnType.TIMESTAMP,
            "date": ColumnType.TIMESTAMP,
        }
