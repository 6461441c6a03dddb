"""The shape of a destination's events, carried from batch to batch.

A ``Shape`` knows, for every leaf path of the events' JSON seen so far (before any step), which
kinds of value it held (``BOOL``, ``INT64``, ``FLOAT64``, ``STRING``, ``JSON`` for objects and
arrays kept whole) and whether its text was always an ISO 8601 date-time. From it come:

- the Spark schema each event's JSON text is parsed with, once, by ``from_json``
  (``text_schema``): a leaf of one kind gets that type; ints and floats ``double``; a leaf that
  held objects or arrays ``variant`` (kept whole, as JSON), and so do other mixes, which keeps
  each value's own kind for typing; date-time text is parsed as text and converted after;
- ``novel(...)``: per event, whether it holds anything the shape does not know (a key the schema
  lacks, a value the parse could not take, a date-time that is not one). It compares the number
  of keys with a non-null value in the JSON text, counted natively on the text, against the
  number of fields the parse filled. The count on the text can only be too high (a ``":`` inside
  a string value counts too), never too low, so an event that fits is sometimes called novel
  (it then takes the slower path) but an event that does not fit is never missed.

Only novel events are inferred (``infer``, native aggregates over the VARIANT parse of just those
events); the shape then widens (``merge``) and the batch is planned again. A batch like the last
one runs with no inference at all.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import reduce

import orjson
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructType,
    TimestampType,
    VariantType,
)

from headwater.destinations.types import ColumnType, promote
from headwater.pipeline.steps.flatten import ISO_TIMESTAMP, parse_schema
from headwater.pipeline.structs import Path, nested

BOOL, INT64, FLOAT64, STRING, JSON = "BOOL", "INT64", "FLOAT64", "STRING", "JSON"
KINDS = (BOOL, INT64, FLOAT64, STRING, JSON)
_WHITESPACE_BEFORE_COLON = ('"\t', '"\n', '"\r')


@dataclass(frozen=True)
class Leaf:
    kinds: frozenset[str]
    timestamp: bool = False  # every STRING value seen was an ISO 8601 date-time

    def merge(self, other: Leaf) -> Leaf:
        kinds = self.kinds | other.kinds
        ts = (STRING not in self.kinds or self.timestamp) and (
            STRING not in other.kinds or other.timestamp
        )
        return Leaf(kinds, ts and STRING in kinds)

    @property
    def parse_type(self) -> DataType:
        """How ``from_json`` reads the leaf."""
        k = self.kinds
        if k == {STRING}:
            return StringType()
        if JSON in k:  # objects and arrays kept whole, as themselves (an archive keeps them)
            return VariantType()
        if k == {BOOL}:
            return BooleanType()
        if k == {INT64}:
            return LongType()
        if k <= {INT64, FLOAT64}:
            return DoubleType()
        return VariantType()

    @property
    def is_timestamp(self) -> bool:
        return self.kinds == {STRING} and self.timestamp

    @property
    def value_type(self) -> DataType:
        """The leaf's type after decoding (date-time text becomes a timestamp)."""
        return TimestampType() if self.is_timestamp else self.parse_type

    @property
    def column_type(self) -> ColumnType:
        """The lattice type of every value the leaf held."""
        if JSON in self.kinds:
            return ColumnType.STRING
        if self.is_timestamp:
            return ColumnType.TIMESTAMP
        types = [ColumnType(k) for k in sorted(self.kinds)]
        return reduce(promote, types[1:], types[0])


@dataclass
class Shape:
    leaves: dict[Path, Leaf] = field(default_factory=dict)

    def merge(self, found: Mapping[Path, Leaf]) -> bool:
        """Widen with what a batch's novel events held; True when anything changed. A path
        that is a leaf in one place and an object in another becomes one JSON leaf."""
        before = dict(self.leaves)
        for path, leaf in found.items():
            have = self.leaves.get(path)
            self.leaves[path] = leaf if have is None else have.merge(leaf)
        # a leaf that is also a parent: keep the parent as a JSON leaf, drop what is below it
        paths = sorted(self.leaves)
        for path in paths:
            if path not in self.leaves:
                continue
            below = [p for p in self.leaves if len(p) > len(path) and p[: len(path)] == path]
            if below:
                kinds = set(self.leaves[path].kinds) | {JSON}
                for p in below:
                    del self.leaves[p]
                self.leaves[path] = Leaf(frozenset(kinds))
        return self.leaves != before

    def text_schema(self) -> StructType:
        return nested({p: leaf.parse_type for p, leaf in self.leaves.items()})

    def kinds_of(self, path: Path) -> frozenset[str]:
        leaf = self.leaves.get(path)
        return leaf.kinds if leaf is not None else frozenset()


# -- per event: does it fit the shape? ---------------------------------------------------------
def key_count(text: Column) -> Column:
    """Keys with a non-null value in JSON text (too high when strings hold ``":``; never too
    low unless whitespace other than a space stands before a colon: see ``novel``). Two
    regex scans, no string built (measured: cheaper than counting by replacement)."""
    keys = F.regexp_count(text, F.lit('" ?:'))
    nulls = F.regexp_count(text, F.lit('" ?: ?null'))
    return keys - nulls


def variant_kind(value: Column) -> Column:
    """Per row, the kind (``KINDS``) of a VARIANT value parsed from JSON; null for null. Read
    from the value's JSON text (first character, and a fraction or exponent for numbers):
    cheaper than ``schema_of_variant``."""
    text = F.to_json(value)
    first = F.substring(text, 1, 1)
    fraction = text.contains(".") | text.contains("e") | text.contains("E")
    return (
        F.when(value.isNull() | (text == "null"), F.lit(None))
        .when(first == '"', F.lit(STRING))
        .when(first.isin("t", "f"), F.lit(BOOL))
        .when(first.isin("{", "["), F.lit(JSON))
        .when(fraction, F.lit(FLOAT64))
        .otherwise(F.lit(INT64))
    )


def novel(text: Column, parsed: Column, shape: Shape) -> Column:
    """Per row: the event (JSON ``text``, ``parsed`` with ``shape.text_schema()``) holds a key,
    a kind or a value the shape does not know, or is not a JSON object the shape can read."""
    present: list[Column] = []
    checks: list[Column] = []
    schema = shape.text_schema()
    _present(parsed, schema, (), shape, present, checks)
    filled = reduce(operator.add, present) if present else F.lit(0)
    odd_space = reduce(operator.or_, [text.contains(s) for s in _WHITESPACE_BEFORE_COLON])
    out = (key_count(text) != filled) | (filled == 0) | odd_space
    for c in checks:
        out = out | c
    return F.coalesce(out, F.lit(True))


def _present(
    node: Column,
    struct: StructType,
    prefix: Path,
    shape: Shape,
    present: list[Column],
    checks: list[Column],
) -> None:
    for f in struct.fields:
        path = (*prefix, f.name)
        value = node.getField(f.name)
        if isinstance(f.dataType, StructType):
            present.append(value.isNotNull().cast("int"))
            _present(value, f.dataType, path, shape, present, checks)
            continue
        leaf = shape.leaves[path]
        one = value.isNotNull().cast("int")
        if JSON in leaf.kinds:  # the keys inside objects and arrays kept whole count too
            one = one + F.coalesce(key_count(F.to_json(value)), F.lit(0))
        present.append(one)
        if isinstance(f.dataType, VariantType):
            kind = variant_kind(value)
            checks.append(kind.isNotNull() & ~kind.isin(*sorted(leaf.kinds)))
        elif leaf.is_timestamp:
            checks.append(value.isNotNull() & ~value.rlike(ISO_TIMESTAMP))


def to_values(parsed: Column, shape: Shape) -> Column:
    """The parsed event with date-time text converted to timestamps (``Leaf.value_type``)."""
    ts = [p for p, leaf in shape.leaves.items() if leaf.is_timestamp]
    if not ts:
        return parsed
    from headwater.pipeline.structs import field_at, field_ref

    out = parsed
    for path in ts:
        # from_json filled every object on the path when the leaf is set
        text = field_at(parsed, path)
        out = out.withField(field_ref(path), text.try_cast("timestamp"))
    return F.when(parsed.isNotNull(), out)


# -- the slow path: what novel events hold ------------------------------------------------------
_ISO = re.compile(ISO_TIMESTAMP, re.ASCII)


def infer_texts(texts: Iterable[str]) -> dict[Path, Leaf]:
    """The leaves of JSON objects given as text, inferred here in Python (a sample of a
    batch's novel events: far cheaper than a Spark job). The same rules as ``infer``."""
    kinds: dict[Path, set[str]] = {}
    iso: dict[Path, bool] = {}
    for text in texts:
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict):
            _walk(value, (), kinds, iso)
    return {
        p: Leaf(frozenset(k), iso.get(p, False) and STRING in k) for p, k in kinds.items()
    }


def _walk(
    obj: dict, prefix: Path, kinds: dict[Path, set[str]], iso: dict[Path, bool]
) -> None:
    for key, value in obj.items():
        path = (*prefix, key)
        if value is None:
            continue
        if isinstance(value, dict) and value:
            _walk(value, path, kinds, iso)
            continue
        if isinstance(value, dict | list):
            kind = JSON
        elif isinstance(value, bool):
            kind = BOOL
        elif isinstance(value, int):
            kind = INT64
        elif isinstance(value, float):
            kind = FLOAT64
        else:
            kind = STRING
            iso[path] = iso.get(path, True) and _ISO.match(value) is not None
        kinds.setdefault(path, set()).add(kind)

def infer(events: DataFrame, column: str) -> dict[Path, Leaf]:
    """The leaves of the VARIANT objects in ``column``: kinds per path, and for text leaves
    whether every value is an ISO 8601 date-time (native aggregates, two small jobs at most)."""
    rows = events.where(F.col(column).isNotNull())
    first = rows.agg(F.schema_of_variant_agg(F.col(column))).first()
    if first is None or first[0] is None:
        return {}
    root = parse_schema(first[0])
    if root.kind != "OBJECT":
        return {}
    found: dict[Path, Leaf] = {}
    probes: dict[Path, list[str]] = {}

    def walk(node: object, prefix: Path) -> None:
        for name, child in node.fields:  # type: ignore[attr-defined]
            path = (*prefix, name)
            if child.kind == "OBJECT":
                if child.fields:
                    walk(child, path)
                else:
                    found[path] = Leaf(frozenset({JSON}))
            elif child.kind == "ARRAY":
                found[path] = Leaf(frozenset({JSON}))
            elif child.kind == "VOID":
                continue
            else:
                probes[path] = [child.kind]

    walk(root, ())
    if not probes:
        return found
    from headwater.pipeline.columns import json_path

    aggs: list[Column] = []
    names: dict[Path, tuple[str, str]] = {}
    for i, path in enumerate(probes):
        value = F.try_variant_get(F.col(column), json_path(path), "variant")
        text = F.try_variant_get(F.col(column), json_path(path), "string")
        kind = variant_kind(value)
        aggs.append(F.collect_set(kind).alias(f"k{i}"))
        iso = F.when(kind == STRING, text.rlike(ISO_TIMESTAMP))
        aggs.append(F.coalesce(F.min(iso), F.lit(False)).alias(f"t{i}"))
        names[path] = (f"k{i}", f"t{i}")
    got = rows.agg(*aggs).first()
    assert got is not None
    for path, (k, t) in names.items():
        kinds = frozenset(got[k] or [])
        if kinds:
            found[path] = Leaf(kinds, bool(got[t]) and STRING in kinds)
    return found
