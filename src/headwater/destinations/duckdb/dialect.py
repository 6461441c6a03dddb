"""DuckDB: the embedded default warehouse. Identifiers keep their case (DuckDB compares them
case-insensitively), so names are folded to lower case to keep one spelling per column."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class DuckDBDialect(Dialect):
    name = "duckdb"
    max_identifier_length = 255
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "BOOLEAN",
        ColumnType.INT64: "BIGINT",
        ColumnType.FLOAT64: "DOUBLE",
        ColumnType.TIMESTAMP: "TIMESTAMPTZ",
        ColumnType.STRING: "VARCHAR",
    }

    def extra_types(self) -> dict[str, ColumnType]:
        return {
            "int8": ColumnType.INT64,
            "float8": ColumnType.FLOAT64,
            "timestamp with time zone": ColumnType.TIMESTAMP,  # as the catalog spells it
            "text": ColumnType.STRING,
            "bool": ColumnType.BOOL,
        }
