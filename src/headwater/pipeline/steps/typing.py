"""Steps 6 and 7, flattening and typing: the columns a batch writes into one table, the SQL
types they need, and the expression that gives each column's value.

Names: a field's path joined with ``_`` (``user.address.city`` -> ``user_address_city``), then
normalised by the destination's dialect. Two fields whose names normalise alike share the
column (the first non-null value wins; the type is their common ancestor). Arrays, and fields
that held objects and values, are stored as their JSON text.

Types against the table as it is (``plan_columns``, pure Python):

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

from headwater.destinations.base import Column, TableSchema
from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType, fits, promote
from headwater.pipeline import sql
from headwater.pipeline.fields import (
    BIGINT,
    BOOLEAN,
    DOUBLE,
    RAW,
    TEXT,
    TIMESTAMP,
    Field,
    as_text,
    kind_in,
    timestamp_of,
)
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, ISO_TIMESTAMP, STRING, Path

SQL_TYPES = {
    ColumnType.BOOL: "BOOLEAN",
    ColumnType.INT64: "BIGINT",
    ColumnType.FLOAT64: "DOUBLE",
    ColumnType.TIMESTAMP: "TIMESTAMPTZ",
    ColumnType.STRING: "VARCHAR",
}
_FORM_TYPES = {BOOLEAN: ColumnType.BOOL, BIGINT: ColumnType.INT64, DOUBLE: ColumnType.FLOAT64}
_KINDS_FITTING: dict[ColumnType, tuple[str, ...]] = {
    ColumnType.BOOL: (BOOL,),
    ColumnType.INT64: (BOOL, INT64),
    ColumnType.FLOAT64: (BOOL, INT64, FLOAT64),
}


@dataclass(frozen=True)
class ColumnPlan:
    column: Column
    fields: tuple[Field, ...]
    accept: ColumnType | None = None  # only values whose own type fits this (None: all)
    reject: ColumnType | None = None  # only values whose own type does NOT fit this


def column_name(path: Path, dialect: Dialect) -> str:
    return dialect.normalize("_".join(path))


def plan_columns(
    fields: list[Field],
    dialect: Dialect,
    existing: TableSchema | None,
    explicit: Mapping[Path, str] | None = None,
) -> list[ColumnPlan]:
    explicit = explicit or {}
    by_name: dict[str, list[Field]] = {}
    for f in fields:
        by_name.setdefault(column_name(f.path, dialect), []).append(f)
    plans: list[ColumnPlan] = []
    for name, group in by_name.items():
        batch_type = group[0].type
        for f in group[1:]:
            batch_type = promote(batch_type, f.type)
        sql_type = next((explicit[f.path] for f in group if f.path in explicit), None)
        have = existing.columns.get(name) if existing is not None else None
        if sql_type is not None:
            wanted = dialect.column_type(sql_type) or batch_type
            plans.append(ColumnPlan(Column(name, wanted, sql_type), tuple(group)))
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


def column_value(plan: ColumnPlan) -> str:
    """The column's value per row (SQL, of the column's type)."""
    target = plan.column.type
    values = [value_as(f, target) for f in plan.fields]
    value = values[0] if len(values) == 1 else f"COALESCE({', '.join(values)})"
    if plan.accept is not None:
        value = f"CASE WHEN {own_fits(plan.fields, plan.accept)} THEN {value} END"
    elif plan.reject is not None:
        value = f"CASE WHEN NOT {own_fits(plan.fields, plan.reject)} THEN {value} END"
    return f"({value})::{SQL_TYPES[target]}"


def value_as(f: Field, target: ColumnType) -> str:
    """The field's value converted to ``target`` (for values whose own type fits it)."""
    if target is ColumnType.STRING:
        return as_text(f)
    if f.form == RAW:
        return _raw_as(f, target)
    if target is ColumnType.TIMESTAMP:
        return f.sql if f.form == TIMESTAMP else timestamp_of(as_text(f))
    own = _FORM_TYPES.get(f.form)
    if own is target:
        return f.sql
    if own is not None and fits(own, target):
        return f"{f.sql}::{SQL_TYPES[target]}"
    return f"TRY_CAST({as_text(f)} AS {SQL_TYPES[target]})"  # an explicit type asked for it


def _raw_as(f: Field, target: ColumnType) -> str:
    x = f.sql
    if target is ColumnType.TIMESTAMP:
        return f"CASE WHEN ascii({x}) = 34 THEN {timestamp_of(as_text(f))} END"
    branches = [(f"ascii({x}) IN (116, 102)", f"({x} = 'true')::{SQL_TYPES[target]}")]
    if target is ColumnType.INT64:
        branches.append((kind_in(f, {INT64}), f"TRY_CAST({x} AS BIGINT)"))
    elif target is ColumnType.FLOAT64:
        branches.append((kind_in(f, {INT64, FLOAT64}), f"TRY_CAST({x} AS DOUBLE)"))
    return sql.case(branches)


def own_fits(fields: tuple[Field, ...], column_type: ColumnType) -> str:
    """Per row: every field's value fits ``column_type`` by its own type (null fits all)."""
    if column_type is ColumnType.STRING:
        return sql.TRUE
    tests = []
    for f in fields:
        if column_type is ColumnType.TIMESTAMP and f.form in (TEXT, RAW):
            text = as_text(f)
            iso = f"regexp_full_match({text}, {sql.lit(ISO_TIMESTAMP)})"
            string = kind_in(f, {STRING})
            tests.append(f"({f.sql} IS NULL OR ({string} AND {iso}))")
        else:
            fitting = (
                {STRING}
                if column_type is ColumnType.STRING
                else _KINDS_FITTING.get(column_type, ())
            )
            tests.append(kind_in(f, set(fitting)) if f.form == RAW else _fits_form(f, column_type))
    return sql.all_of(t for t in tests if t != sql.TRUE)


def _fits_form(f: Field, column_type: ColumnType) -> str:
    return sql.TRUE if fits(f.type, column_type) else f"({f.sql} IS NULL)"
