"""Step 6, flattening: which leaf fields a batch's events have, and what type each holds.

``infer_fields(df)`` looks at the batch (one aggregation for the merged schema of every event,
``schema_of_variant_agg``, and one more for what a schema cannot tell: whether text fields hold
timestamps, and which types a field of mixed types holds) and returns one ``Field`` per leaf:

- nested objects become ``parent_child`` names (``("user", "address", "city")``);
- arrays, and fields that are an object in some events and a value in others, are stored as
  JSON text (STRING);
- a field that is null in every event of the batch gets no column (nothing to type it by);
- types follow the lattice of ``headwater.destinations.types``: within a batch a field takes
  the lowest common ancestor of its values' types (int and float: FLOAT64; int and text:
  STRING; timestamp and float: STRING);
- text is a TIMESTAMP when every value of the field in the batch is an ISO 8601 date-time
  (``2024-05-01T12:00:00Z``, ``2024-05-01 12:00:00.123+02:00``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
    VariantType,
)

from headwater.destinations.types import ColumnType, promote
from headwater.pipeline.structs import Path, leaves

ISO_TIMESTAMP = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|z|[+-]\d{2}(:?\d{2})?)?$"


@dataclass(frozen=True)
class Field:
    path: Path
    type: ColumnType
    json_text: bool = False  # stored as JSON text (arrays, objects mixed with values)
    kinds: frozenset[str] = frozenset()  # a VARIANT leaf: the kinds its values have


# -- the variant schema strings Spark prints: OBJECT<a: BIGINT, `b c`: ARRAY<STRING>> ----------
@dataclass(frozen=True)
class _Node:
    kind: str  # OBJECT, ARRAY, VARIANT, VOID, or a scalar type name (BIGINT, DECIMAL(3,1), ...)
    fields: tuple[tuple[str, _Node], ...] = ()


def parse_schema(text: str) -> _Node:
    """Parse what ``schema_of_variant(_agg)`` returns."""
    node, pos = _parse(text, 0)
    if pos != len(text):
        raise ValueError(f"unexpected text at {pos} in variant schema {text!r}")
    return node


def _parse(s: str, i: int) -> tuple[_Node, int]:
    m = re.compile(r"[A-Z_]+(\(\d+\s*,\s*\d+\))?").match(s, i)
    if m is None:
        raise ValueError(f"no type at {i} in variant schema {s!r}")
    kind, i = m.group(0), m.end()
    if kind == "OBJECT":
        i = _expect(s, i, "<")
        fields: list[tuple[str, _Node]] = []
        while s[i] != ">":
            name, i = _name(s, i)
            i = _expect(s, i, ":")
            while s[i] == " ":
                i += 1
            child, i = _parse(s, i)
            fields.append((name, child))
            if s[i] == ",":
                i += 1
                while s[i] == " ":
                    i += 1
        return _Node("OBJECT", tuple(fields)), i + 1
    if kind == "ARRAY":
        i = _expect(s, i, "<")
        _, i = _parse(s, i)
        return _Node("ARRAY"), _expect(s, i, ">")
    return _Node(kind), i


def _name(s: str, i: int) -> tuple[str, int]:
    if s[i] == "`":
        out = []
        i += 1
        while True:
            if s[i] == "`":
                if i + 1 < len(s) and s[i + 1] == "`":
                    out.append("`")
                    i += 2
                    continue
                return "".join(out), i + 1
            out.append(s[i])
            i += 1
    m = re.compile(r"[^:]+").match(s, i)
    assert m is not None
    return m.group(0), m.end()


def _expect(s: str, i: int, char: str) -> int:
    if s[i] != char:
        raise ValueError(f"expected {char!r} at {i} in variant schema {s!r}")
    return i + 1


def scalar_type(kind: str) -> ColumnType | None:
    """The lattice type of a variant scalar type name; None for VOID (null)."""
    if kind == "BOOLEAN":
        return ColumnType.BOOL
    if kind in ("TINYINT", "SMALLINT", "INT", "BIGINT"):
        return ColumnType.INT64
    if kind.startswith("DECIMAL"):
        m = re.match(r"DECIMAL\((\d+),\s*(\d+)\)", kind)
        if m and m.group(2) == "0" and int(m.group(1)) <= 18:
            return ColumnType.INT64
        return ColumnType.FLOAT64
    if kind in ("FLOAT", "DOUBLE"):
        return ColumnType.FLOAT64
    if kind in ("TIMESTAMP", "TIMESTAMP_NTZ", "DATE"):
        return ColumnType.TIMESTAMP
    if kind == "VOID":
        return None
    return ColumnType.STRING  # STRING, BINARY, UUID, ...


# -- the batch's columns --------------------------------------------------------------------
def fields_of(
    struct: DataType, kinds: Callable[[Path], frozenset[str]] = lambda _: frozenset()
) -> list[Field]:
    """One ``Field`` per leaf of the events' struct type. ``kinds`` tells, for a leaf that holds
    values of several kinds (a VARIANT leaf), which kinds (``headwater.pipeline.shape``)."""
    if not isinstance(struct, StructType):
        return []
    out: list[Field] = []
    for path, t in leaves(struct):
        if isinstance(t, BooleanType):
            out.append(Field(path, ColumnType.BOOL))
        elif isinstance(t, LongType | IntegerType | ShortType | ByteType):
            out.append(Field(path, ColumnType.INT64))
        elif isinstance(t, DoubleType | FloatType | DecimalType):
            out.append(Field(path, ColumnType.FLOAT64))
        elif isinstance(t, TimestampType | TimestampNTZType | DateType):
            out.append(Field(path, ColumnType.TIMESTAMP))
        elif isinstance(t, StringType):
            out.append(Field(path, ColumnType.STRING))
        elif isinstance(t, VariantType):
            k = kinds(path) or frozenset({"STRING"})
            if "JSON" in k:
                out.append(Field(path, ColumnType.STRING, json_text=True, kinds=k))
            else:
                types = [ColumnType(x) for x in sorted(k)]
                out.append(Field(path, reduce(promote, types[1:], types[0]), kinds=k))
        else:  # arrays, maps, binary: kept whole as JSON text
            out.append(Field(path, ColumnType.STRING, json_text=True))
    return out
