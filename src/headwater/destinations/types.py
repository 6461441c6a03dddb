"""headwater's column types: the seed's type lattice, shared by the pipeline and every dialect.

    STRING
    /    \\
 FLOAT64  TIMESTAMP
    |
  INT64
    |
   BOOL

A column's values all fit the lowest type above every value's own type (``promote``). Arrays and
objects that are kept whole are stored as JSON text (STRING).
"""

from __future__ import annotations

from enum import StrEnum


class ColumnType(StrEnum):
    BOOL = "BOOL"
    INT64 = "INT64"
    FLOAT64 = "FLOAT64"
    TIMESTAMP = "TIMESTAMP"
    STRING = "STRING"


# Each type's parent in the lattice (STRING is the root).
_PARENT: dict[ColumnType, ColumnType | None] = {
    ColumnType.BOOL: ColumnType.INT64,
    ColumnType.INT64: ColumnType.FLOAT64,
    ColumnType.FLOAT64: ColumnType.STRING,
    ColumnType.TIMESTAMP: ColumnType.STRING,
    ColumnType.STRING: None,
}


def ancestors(t: ColumnType) -> list[ColumnType]:
    """``t`` and every type above it, from ``t`` up to STRING."""
    out = [t]
    parent = _PARENT[t]
    while parent is not None:
        out.append(parent)
        parent = _PARENT[parent]
    return out


def promote(a: ColumnType, b: ColumnType) -> ColumnType:
    """The lowest common ancestor of ``a`` and ``b`` (FLOAT64 and TIMESTAMP give STRING)."""
    above_a = ancestors(a)
    for t in ancestors(b):
        if t in above_a:
            return t
    return ColumnType.STRING  # unreachable: STRING is above everything


def fits(value_type: ColumnType, column_type: ColumnType) -> bool:
    """A value of ``value_type`` can be stored in a ``column_type`` column without loss."""
    return column_type in ancestors(value_type)
