"""Google BigQuery (dialect only). Column names are case-insensitive but keep their case, at most
300 characters; quoted with backticks. No primary keys are declared (BigQuery's are not
enforced): upserts there need a MERGE, which a loader would issue."""

from __future__ import annotations

from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType


class BigQueryDialect(Dialect):
    name = "bigquery"
    max_identifier_length = 300
    lower_case = False
    quote_char = "`"
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "BOOL",
        ColumnType.INT64: "INT64",
        ColumnType.FLOAT64: "FLOAT64",
        ColumnType.TIMESTAMP: "TIMESTAMP",
        ColumnType.STRING: "STRING",
    }

    def quote(self, identifier: str) -> str:
        return "`" + identifier.replace("\\", "\\\\").replace("`", "\\`") + "`"

    def create_table_sql(
        self, table: str, columns: list[tuple[str, str]], primary_key: tuple[str, ...] = ()
    ) -> str:
        return super().create_table_sql(table, columns)
