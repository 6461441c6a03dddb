"""What a SQL dialect says about names and types; one subclass per warehouse.

Every dialect maps headwater's ``ColumnType`` to its SQL type (the seed's table of implicit
types), reads its own SQL types back to a ``ColumnType`` (to compare a table with a batch),
normalises identifiers (special characters and spaces to ``_``, case, length), quotes them, and
writes the DDL that table patching runs.
"""

from __future__ import annotations

import re
from abc import ABC
from typing import ClassVar

from headwater.destinations.types import ColumnType

_SPECIAL = re.compile(r"[^0-9A-Za-z_]")


class Dialect(ABC):
    name: ClassVar[str]
    types: ClassVar[dict[ColumnType, str]]
    max_identifier_length: ClassVar[int] = 63
    lower_case: ClassVar[bool] = True
    quote_char: ClassVar[str] = '"'
    add_column_if_not_exists: ClassVar[bool] = True  # ALTER TABLE ... ADD COLUMN IF NOT EXISTS

    def normalize(self, name: str) -> str:
        """A column or table name as this warehouse stores it: characters other than letters,
        digits and ``_`` become ``_``; lower case where the warehouse folds case; a leading
        digit gets a ``_`` prefix; cut to the longest identifier allowed."""
        out = _SPECIAL.sub("_", name)
        if self.lower_case:
            out = out.lower()
        if not out or out[0].isdigit():
            out = "_" + out
        return out[: self.max_identifier_length]

    def quote(self, identifier: str) -> str:
        q = self.quote_char
        return q + identifier.replace(q, q + q) + q

    def sql_type(self, t: ColumnType) -> str:
        return self.types[t]

    def column_type(self, sql_type: str) -> ColumnType | None:
        """The ``ColumnType`` whose values a column of ``sql_type`` holds, or None when it is
        none of ours (such a column only takes values that are cast to it explicitly)."""
        wanted = _canonical(sql_type)
        for t, name in self.types.items():
            if _canonical(name) == wanted:
                return t
        return self.extra_types().get(wanted)

    def extra_types(self) -> dict[str, ColumnType]:
        """Other spellings this warehouse reports for our types (``int8`` for ``bigint``)."""
        return {}

    def create_table_sql(
        self, table: str, columns: list[tuple[str, str]], primary_key: tuple[str, ...] = ()
    ) -> str:
        cols = [f"{self.quote(name)} {sql}" for name, sql in columns]
        if primary_key:
            cols.append(f"PRIMARY KEY ({', '.join(self.quote(c) for c in primary_key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.quote(table)} ({', '.join(cols)})"

    def add_column_sql(self, table: str, column: str, sql_type: str) -> str:
        guard = " IF NOT EXISTS" if self.add_column_if_not_exists else ""
        return f"ALTER TABLE {self.quote(table)} ADD COLUMN{guard} {self.quote(column)} {sql_type}"


def _canonical(sql_type: str) -> str:
    return re.sub(r"\s+", " ", sql_type.strip().lower())
