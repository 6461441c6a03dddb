"""Step 7, typing: the columns a batch writes into one table, and the SQL types they need.

``plan_columns`` decides (pure Python); ``project`` turns the decision into a DataFrame whose
columns have the decided names and Spark types, ready to hand to the destination as Arrow.

Names: a field's path joined with ``_`` (``user.address.city`` -> ``user_address_city``), then
normalised by the destination's dialect. Two fields whose names normalise alike share the
column (the first non-null value wins; the type is their common ancestor).

Types against the table as it is:

- a column the table lacks gets the batch's type (or the explicit type of a mapping rule);
- a column whose type holds the batch's type (``fits``: BOOL into INT64, INT64 into FLOAT64,
  anything into STRING) takes every value, converted;
- **values are never lost or truncated**: when the batch's values do not all fit the
  existing column's type (text arriving for an INT64 column, a float for a BOOL column), the
  values that fit still go to the column, and the others go to the column
  ``<name>__<type>`` (``price__float64``, ``flag__string``), created as needed with the
  values' own type. Readers find every value in one of the two;
- a column of a type that is none of headwater's (a user's ``jsonb``, an explicit cast) takes
  the values as the batch types them, and the warehouse converts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.destinations.base import Column, TableSchema
from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType, fits, promote
from headwater.pipeline.columns import EVENT, json_path
from headwater.pipeline.steps.flatten import ISO_TIMESTAMP, Field, Path, row_kind, value_at

SPARK_TYPES = {
    ColumnType.BOOL: "boolean",
    ColumnType.INT64: "bigint",
    ColumnType.FLOAT64: "double",
    ColumnType.TIMESTAMP: "timestamp",
    ColumnType.STRING: "string",
}


@dataclass(frozen=True)
class ColumnPlan:
    column: Column
    fields: tuple[Field, ...]
    accept: ColumnType | None = None  # only values whose own type fits this (None: all)
    reject: ColumnType | None = None  # only values whose own type does NOT fit this


def plan_columns(
    fields: list[Field],
    dialect: Dialect,
    existing: TableSchema | None,
    explicit: Mapping[Path, str] | None = None,
) -> list[ColumnPlan]:
    explicit = explicit or {}
    by_name: dict[str, list[Field]] = {}
    for f in fields:
        by_name.setdefault(dialect.normalize("_".join(f.path)), []).append(f)
    plans: list[ColumnPlan] = []
    for name, group in by_name.items():
        batch_type = group[0].type
        for f in group[1:]:
            batch_type = promote(batch_type, f.type)
        sql = next((explicit[f.path] for f in group if f.path in explicit), None)
        have = existing.columns.get(name) if existing is not None else None
        if sql is not None:
            wanted = dialect.column_type(sql) or batch_type
            plans.append(ColumnPlan(Column(name, wanted, sql), tuple(group)))
        elif have is None:
            plans.append(ColumnPlan(Column(name, batch_type), tuple(group)))
        elif have.sql_type is not None and dialect.column_type(have.sql_type) is None:
            plans.append(ColumnPlan(Column(name, batch_type, have.sql_type), tuple(group)))
        elif fits(batch_type, have.type):
            plans.append(ColumnPlan(Column(name, have.type), tuple(group)))
        else:
            plans.append(ColumnPlan(Column(name, have.type), tuple(group), accept=have.type))
            variant = dialect.normalize(f"{name}__{batch_type.value.lower()}")
            plans.append(ColumnPlan(Column(variant, batch_type), tuple(group), reject=have.type))
    return plans


def target_schema(
    table: str, plans: list[ColumnPlan], primary_key: tuple[str, ...] = ()
) -> TableSchema:
    return TableSchema(table, {p.column.name: p.column for p in plans}, primary_key)


def project(df: DataFrame, plans: list[ColumnPlan], keep: tuple[str, ...] = ()) -> DataFrame:
    """One column per plan (named and typed as planned), plus the columns ``keep``."""
    cols = [F.col(c) for c in keep]
    for plan in plans:
        values = [_value(f, plan.column.type) for f in plan.fields]
        value = values[0] if len(values) == 1 else F.coalesce(*values)
        if plan.accept is not None or plan.reject is not None:
            own = _own_fits(plan.fields, plan.accept or plan.reject)  # type: ignore[arg-type]
            keep_it = own if plan.accept is not None else ~own
            value = F.when(keep_it, value)
        cols.append(value.cast(SPARK_TYPES[plan.column.type]).alias(plan.column.name))
    return df.select(*cols)


def _value(f: Field, as_type: ColumnType) -> SparkColumn:
    """The field's value converted to ``as_type`` (which holds the field's type)."""
    event = F.col(EVENT)
    if as_type is ColumnType.STRING:
        if f.json_text:
            raw = value_at(f.path)
            kind = row_kind(f.path)
            as_json = F.to_json(raw)
            as_text = F.try_variant_get(event, json_path(f.path), "string")
            return F.when(kind.isin("OBJECT", "ARRAY"), as_json).otherwise(as_text)
        if f.type is ColumnType.TIMESTAMP:
            ts = F.try_variant_get(event, json_path(f.path), "timestamp")
            text = F.try_variant_get(event, json_path(f.path), "string")
            return F.coalesce(F.date_format(ts, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"), text)
        return F.try_variant_get(event, json_path(f.path), "string")
    return F.try_variant_get(event, json_path(f.path), SPARK_TYPES[as_type])


_KIND_TYPES: dict[ColumnType, tuple[str, ...]] = {
    ColumnType.BOOL: ("BOOLEAN",),
    ColumnType.INT64: ("BOOLEAN", "TINYINT", "SMALLINT", "INT", "BIGINT"),
    ColumnType.FLOAT64: ("BOOLEAN", "TINYINT", "SMALLINT", "INT", "BIGINT", "FLOAT", "DOUBLE"),
    ColumnType.TIMESTAMP: ("TIMESTAMP", "TIMESTAMP_NTZ", "DATE"),
}


def _own_fits(fields: tuple[Field, ...], column_type: ColumnType) -> SparkColumn:
    """Per row: the value's own type fits ``column_type`` (null values fit anything)."""
    if column_type is ColumnType.STRING:
        return F.lit(True)
    tests = []
    for f in fields:
        kind = F.schema_of_variant(value_at(f.path))
        ok = kind.isNull() | (kind == "VOID") | kind.isin(*_KIND_TYPES[column_type])
        if column_type in (ColumnType.INT64, ColumnType.FLOAT64):
            decimal = kind.startswith("DECIMAL")
            scale0 = F.regexp_extract(kind, r",\s*(\d+)\)", 1) == "0"
            ok = ok | (decimal & (scale0 | F.lit(column_type is ColumnType.FLOAT64)))
        if column_type is ColumnType.TIMESTAMP:
            text = F.try_variant_get(F.col(EVENT), json_path(f.path), "string")
            ok = ok | ((kind == "STRING") & text.rlike(ISO_TIMESTAMP))
        tests.append(ok)
    out = tests[0]
    for t in tests[1:]:
        out = out & t
    return out
