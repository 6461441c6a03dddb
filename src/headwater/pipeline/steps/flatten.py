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
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.destinations.types import ColumnType, promote
from headwater.pipeline.columns import EVENT, json_path

ISO_TIMESTAMP = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|z|[+-]\d{2}(:?\d{2})?)?$"
Path = tuple[str, ...]


@dataclass(frozen=True)
class Field:
    path: Path
    type: ColumnType
    json_text: bool = False  # stored as JSON text (arrays, objects mixed with values)


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


# -- inference ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Candidate:
    path: Path
    kind: str  # "scalar", "json", "mixed", "string"
    type: ColumnType | None = None


def _candidates(node: _Node, prefix: Path = ()) -> list[_Candidate]:
    out: list[_Candidate] = []
    for name, child in node.fields:
        path = (*prefix, name)
        if child.kind == "OBJECT":
            out.extend(_candidates(child, path))
        elif child.kind == "ARRAY":
            out.append(_Candidate(path, "json", ColumnType.STRING))
        elif child.kind == "VARIANT":
            out.append(_Candidate(path, "mixed"))
        else:
            t = scalar_type(child.kind)
            if t is ColumnType.STRING:
                out.append(_Candidate(path, "string", t))
            elif t is not None:
                out.append(_Candidate(path, "scalar", t))
    return out


def value_at(path: Path) -> Column:
    return F.try_variant_get(F.col(EVENT), json_path(path), "variant")


def row_kind(path: Path) -> Column:
    """Per row: the variant type name of the value at ``path`` (OBJECT<...> cut to OBJECT)."""
    return F.split(F.schema_of_variant(value_at(path)), "<")[0]


def merged_schema() -> Column:
    """The aggregate ``infer_fields`` starts from (callers may compute it along with others)."""
    return F.schema_of_variant_agg(F.col(EVENT))


def infer_fields(df: DataFrame, schema: str | None = None) -> list[Field]:
    """The batch's leaf fields and their types (see the module's docstring); ``schema``: the
    rows' ``merged_schema()`` when already computed."""
    rows = df.where(F.col(EVENT).isNotNull())
    if schema is None:
        first = rows.agg(merged_schema()).first()
        schema = None if first is None else first[0]
    if schema is None:
        return []
    root = parse_schema(schema)
    if root.kind != "OBJECT":
        return []
    candidates = _candidates(root)
    probes: list[Column] = []
    for i, c in enumerate(candidates):
        if c.kind == "string":
            text = F.try_variant_get(F.col(EVENT), json_path(c.path), "string")
            probes.append(
                F.min(F.when(text.isNull(), True).otherwise(text.rlike(ISO_TIMESTAMP))).alias(
                    f"p{i}"
                )
            )
        elif c.kind == "mixed":
            probes.append(F.collect_set(row_kind(c.path)).alias(f"p{i}"))
    found = rows.agg(*probes).first() if probes else None
    fields: list[Field] = []
    for i, c in enumerate(candidates):
        if c.kind == "scalar":
            assert c.type is not None
            fields.append(Field(c.path, c.type))
        elif c.kind == "json":
            fields.append(Field(c.path, ColumnType.STRING, json_text=True))
        elif c.kind == "string":
            assert found is not None
            is_ts = bool(found[f"p{i}"])
            fields.append(Field(c.path, ColumnType.TIMESTAMP if is_ts else ColumnType.STRING))
        else:
            assert found is not None
            kinds = set(found[f"p{i}"] or [])
            field = _mixed(c.path, kinds)
            if field is not None:
                fields.append(field)
    return fields


def _mixed(path: Path, kinds: set[str]) -> Field | None:
    if kinds & {"OBJECT", "ARRAY"}:
        return Field(path, ColumnType.STRING, json_text=True)
    types = [t for t in (scalar_type(k) for k in kinds) if t is not None]
    if not types:
        return None
    out = types[0]
    for t in types[1:]:
        out = promote(out, t)
    return Field(path, out)
