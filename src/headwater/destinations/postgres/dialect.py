"""PostgreSQL: the seed's types, except that floating-point values go to unconstrained
``numeric`` rather than ``numeric(38,18)``, which rounds past 18 decimals and refuses values of
more than 20 integer digits (a value would be lost or a whole batch refused)."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class PostgresDialect(Dialect):
    name = "postgres"
    max_identifier_length = 63
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "boolean",
        ColumnType.INT64: "bigint",
        ColumnType.FLOAT64: "numeric",
        ColumnType.TIMESTAMP: "timestamptz",
        ColumnType.STRING: "text",
    }

    def extra_types(self) -> dict[str, ColumnType]:
        return {
            "int8": ColumnType.INT64,
            "timestamp with time zone": ColumnType.TIMESTAMP,  # as format_type spells it
            "double precision": ColumnType.FLOAT64,
            "numeric(38,18)": ColumnType.FLOAT64,
            "character varying": ColumnType.STRING,
            "bool": ColumnType.BOOL,
        }
