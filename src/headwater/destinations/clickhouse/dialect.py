"""ClickHouse (embedded through chdb, or a server). The seed's types, every column Nullable
(events lack fields); tables are MergeTree, or ReplacingMergeTree ordered by the primary key,
which ClickHouse deduplicates in the background (read with FINAL for exact results).

Identifiers are case-sensitive there; names are folded to lower case to keep one spelling per
column. ClickHouse sets no length limit of its own, but a MergeTree part stores each column in
files named after it, so names are cut at 255 characters, the usual file-name limit."""

from __future__ import annotations

import re
from typing import ClassVar

from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType

_NULLABLE = re.compile(r"^nullable\((.*)\)$", re.IGNORECASE)


class ClickHouseDialect(Dialect):
    name = "clickhouse"
    max_identifier_length = 255
    lower_case = False
    quote_char = "`"
    types: ClassVar[dict[ColumnType, str]] = {
        ColumnType.BOOL: "UInt8",
        ColumnType.INT64: "Int64",
        ColumnType.FLOAT64: "Float64",
        ColumnType.TIMESTAMP: "DateTime64(6, 'UTC')",
        ColumnType.STRING: "String",
    }

    def normalize(self, name: str) -> str:
        return super().normalize(name).lower()

    def sql_type(self, t: ColumnType) -> str:
        return f"Nullable({self.types[t]})"

    def column_type(self, sql_type: str) -> ColumnType | None:
        match = _NULLABLE.match(sql_type.strip())
        inner = match.group(1) if match else sql_type
        return super().column_type(inner) or {"bool": ColumnType.BOOL}.get(inner.lower())

    def create_table_sql(
        self, table: str, columns: list[tuple[str, str]], primary_key: tuple[str, ...] = ()
    ) -> str:
        cols = ", ".join(
            f"{self.quote(n)} {self._key_type(sql) if n in primary_key else sql}"
            for n, sql in columns
        )
        if primary_key:
            order = ", ".join(self.quote(c) for c in primary_key)
            engine = f"ReplacingMergeTree ORDER BY ({order})"
        else:
            engine = "MergeTree ORDER BY tuple()"
        return (
            f"CREATE TABLE IF NOT EXISTS {self.quote(table)} ({cols}) ENGINE = {engine} "
            "SETTINGS non_replicated_deduplication_window = 10000"
        )

    @staticmethod
    def _key_type(sql: str) -> str:
        """Sorting-key columns cannot be Nullable."""
        match = _NULLABLE.match(sql)
        return match.group(1) if match else sql
