"""Step 6, flattening: which leaf fields a batch's events have, and what type each holds.

``infer_fields(df)`` looks at the batch (one aggregation for the merged schema of every event,
``schema_of_variant_agg``, and one more for what a schema cannot tell: whether text fields hold
timestamps, and which types a field of mixed types holds) and returns one ``Field`` per leaf.
Callers may compute both ahead, in a job of their own (``merged_schema``, ``probes_for``):
the writer does, for the fields the previous batch had, so a batch like the last one needs no
inference pass of its own.

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

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


Probe = tuple[Path, str]  # (path, candidate kind): what an aggregate probe answers


def candidates(schema: str | None) -> list[_Candidate]:
    """The leaf fields a merged schema (``merged_schema()``) shows."""
    if schema is None:
        return []
    root = parse_schema(schema)
    return _candidates(root) if root.kind == "OBJECT" else []


def probe_name(probe: Probe) -> str:
    """A stable column name for a probe's aggregate."""
    return "_hw_probe_" + hashlib.sha1(repr(probe).encode()).hexdigest()[:16]


def probes_for(found: list[_Candidate]) -> dict[Probe, Column]:
    """The aggregates ``fields_from`` needs for ``found``: for text fields whether every value
    is an ISO timestamp, for mixed fields which kinds of value they hold."""
    out: dict[Probe, Column] = {}
    for c in found:
        key = (c.path, c.kind)
        if c.kind == "string":
            text = F.try_variant_get(F.col(EVENT), json_path(c.path), "string")
            out[key] = F.min(F.when(text.isNull(), True).otherwise(text.rlike(ISO_TIMESTAMP)))
        elif c.kind == "mixed":
            out[key] = F.collect_set(row_kind(c.path))
    return out


def fields_from(found: list[_Candidate], answers: Mapping[Probe, Any]) -> list[Field]:
    """The fields, given each probe's answer (``probes_for``'s aggregates over the rows)."""
    fields: list[Field] = []
    for c in found:
        if c.kind == "scalar":
            assert c.type is not None
            fields.append(Field(c.path, c.type))
        elif c.kind == "json":
            fields.append(Field(c.path, ColumnType.STRING, json_text=True))
        elif c.kind == "string":
            is_ts = bool(answers[(c.path, c.kind)])
            fields.append(Field(c.path, ColumnType.TIMESTAMP if is_ts else ColumnType.STRING))
        else:
            field = _mixed(c.path, set(answers[(c.path, c.kind)] or []))
            if field is not None:
                fields.append(field)
    return fields


def infer_fields(
    df: DataFrame, schema: str | None = None, answered: Mapping[Probe, Any] | None = None
) -> list[Field]:
    """The batch's leaf fields and their types (see the module's docstring). ``schema``: the
    rows' ``merged_schema()`` when already computed; ``answered``: probes already computed
    over the same rows (only the others are aggregated here)."""
    rows = df.where(F.col(EVENT).isNotNull())
    if schema is None:
        first = rows.agg(merged_schema()).first()
        schema = None if first is None else first[0]
    found = candidates(schema)
    answers = dict(answered or {})
    missing = {k: v for k, v in probes_for(found).items() if k not in answers}
    if missing:
        names = {k: probe_name(k) for k in missing}
        row = rows.agg(*[c.alias(names[k]) for k, c in missing.items()]).first()
        assert row is not None
        answers.update({k: row[names[k]] for k in missing})
    return fields_from(found, answers)


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
