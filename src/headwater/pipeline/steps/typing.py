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
from functools import reduce

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.destinations.base import Column, TableSchema
from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType, fits, promote
from headwater.pipeline.columns import EVENT
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, JSON, STRING, variant_kind
from headwater.pipeline.steps.flatten import ISO_TIMESTAMP, Field
from headwater.pipeline.structs import Path, field_at

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
    return df.select(*[F.col(c) for c in keep], *columns(plans))


def columns(plans: list[ColumnPlan], event: SparkColumn | None = None) -> list[SparkColumn]:
    """The planned columns as expressions over the event struct (``event``, by default the
    column ``event``)."""
    return [value.alias(name) for name, value in column_values(plans, event)]


def column_values(
    plans: list[ColumnPlan], event: SparkColumn | None = None
) -> list[tuple[str, SparkColumn]]:
    """(column name, value expression) per plan, over the event struct."""
    event = F.col(EVENT) if event is None else event
    out = []
    for plan in plans:
        values = [_value(event, f, plan.column.type) for f in plan.fields]
        value = values[0] if len(values) == 1 else F.coalesce(*values)
        if plan.accept is not None or plan.reject is not None:
            own = _own_fits(event, plan.fields, plan.accept or plan.reject)  # type: ignore[arg-type]
            keep_it = own if plan.accept is not None else ~own
            value = F.when(keep_it, value)
        out.append((plan.column.name, value.cast(SPARK_TYPES[plan.column.type])))
    return out


def _leaf(event: SparkColumn, f: Field) -> SparkColumn:
    return field_at(event, f.path)


def _value(event: SparkColumn, f: Field, as_type: ColumnType) -> SparkColumn:
    """The field's value converted to ``as_type`` (which holds the field's type)."""
    leaf = _leaf(event, f)
    if f.kinds:  # a VARIANT leaf
        if as_type is ColumnType.STRING:
            return F.when(variant_kind(leaf) == JSON, F.to_json(leaf)).otherwise(
                F.try_variant_get(leaf, "$", "string")
            )
        return F.try_variant_get(leaf, "$", SPARK_TYPES[as_type])
    if as_type is ColumnType.STRING and f.type is ColumnType.TIMESTAMP:
        return F.date_format(leaf, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX")
    if f.json_text and as_type is ColumnType.STRING:
        return F.to_json(leaf)
    return leaf


_KINDS_FITTING: dict[ColumnType, tuple[str, ...]] = {
    ColumnType.BOOL: (BOOL,),
    ColumnType.INT64: (BOOL, INT64),
    ColumnType.FLOAT64: (BOOL, INT64, FLOAT64),
}


def _own_fits(
    event: SparkColumn, fields: tuple[Field, ...], column_type: ColumnType
) -> SparkColumn:
    """Per row: the value's own type fits ``column_type`` (null values fit anything)."""
    if column_type is ColumnType.STRING:
        return F.lit(True)
    tests = []
    for f in fields:
        leaf = _leaf(event, f)
        if not f.kinds and f.type is ColumnType.STRING and column_type is ColumnType.TIMESTAMP:
            tests.append(leaf.isNull() | leaf.rlike(ISO_TIMESTAMP))  # date-time text fits
            continue
        if not f.kinds:  # one kind for every value: decided here
            tests.append(F.lit(fits(f.type, column_type)))
            continue
        kind = variant_kind(leaf)
        if column_type is ColumnType.TIMESTAMP:
            text = F.try_variant_get(leaf, "$", "string")
            ok = kind.isNull() | ((kind == STRING) & text.rlike(ISO_TIMESTAMP))
        else:
            ok = kind.isNull() | kind.isin(*_KINDS_FITTING[column_type])
        tests.append(ok)
    return reduce(lambda a, b: a & b, tests)
