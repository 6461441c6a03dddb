"""Amazon Redshift (dialect only: there is no Redshift to load into here). The seed's types,
except ``double precision`` for floating-point values: Redshift's numeric holds at most 38
digits, and ``numeric(38,18)`` would round or refuse values. Redshift has no
``ADD COLUMN IF NOT EXISTS``; identifiers fold to lower case, at most 127 bytes."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class RedshiftDialect(Dialect):
    name = "redshift"
    max_identifier_length = 127
    add_column_if_not_exists = False
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "boolean",
        ColumnType.INT64: "bigint",
        ColumnType.FLOAT64: "double precision",
        ColumnType.TIMESTAMP: "timestamptz",
        ColumnType.STRING: "character varying(65535)",
    }

    def extra_types(self) -> dict[str, ColumnType]:
        return {  # as Redshift's catalog (pg_table_def, SVV_COLUMNS) spells them
            "timestamp with time zone": ColumnType.TIMESTAMP,
            "numeric(38,18)": ColumnType.FLOAT64,
            "character varying": ColumnType.STRING,
        }
