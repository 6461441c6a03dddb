"""Snowflake (dialect only). Unquoted identifiers fold to upper case there, so names are
normalised to upper case (and quoted, which keeps them as written), at most 255 characters;
``float`` for floating-point values rather than the seed's ``numeric(38,18)`` (which rounds or
refuses values)."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class SnowflakeDialect(Dialect):
    name = "snowflake"
    max_identifier_length = 255
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "boolean",
        ColumnType.INT64: "bigint",
        ColumnType.FLOAT64: "float",
        ColumnType.TIMESTAMP: "timestamp_tz",
        ColumnType.STRING: "text",
    }

    def extra_types(self) -> dict[str, ColumnType]:
        return {  # as Snowflake's information_schema spells them
            "number(38,0)": ColumnType.INT64,
            "number(38,18)": ColumnType.FLOAT64,
            "numeric(38,18)": ColumnType.FLOAT64,
            "varchar(16777216)": ColumnType.STRING,
        }

    def normalize(self, name: str) -> str:
        return super().normalize(name).upper()
