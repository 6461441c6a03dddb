"""Flattening, type inference and promotion, and the never-lose-a-value rule against existing
columns, on tiny DataFrames."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import ClassVar

import pytest

from headwater.destinations.base import Column, TableSchema
from headwater.destinations.dialect import Dialect
from headwater.destinations.types import ColumnType as T
from headwater.destinations.types import fits, promote
from headwater.pipeline import shape as sh
from headwater.pipeline.columns import EVENT
from headwater.pipeline.steps import flatten
from headwater.pipeline.steps.decode import infer_shape, json_text, parse
from headwater.pipeline.steps.flatten import parse_schema
from headwater.pipeline.steps.typing import plan_columns, project, target_schema
from headwater.testing.pipeline import batch


class Plain(Dialect):
    name = "plain"
    types: ClassVar[dict[T, str]] = {
        T.BOOL: "BOOLEAN",
        T.INT64: "BIGINT",
        T.FLOAT64: "DOUBLE",
        T.TIMESTAMP: "TIMESTAMPTZ",
        T.STRING: "VARCHAR",
    }


DIALECT = Plain()


def decoded(spark, values):
    """The batch parsed against its own shape, and its fields."""
    df = json_text(batch(spark, values))
    shape: sh.Shape = infer_shape(df)
    df = parse(df, shape)
    return df, flatten.fields_of(df.schema[EVENT].dataType, shape.kinds_of)


def fields_of(spark, values):
    return {f.path: f for f in decoded(spark, values)[1]}


def rows_of(spark, values, existing=None, explicit=None):
    df, fields = decoded(spark, values)
    plans = plan_columns(fields, DIALECT, existing, explicit)
    out = project(df.orderBy("offset"), plans)
    return target_schema("t", plans), [r.asDict() for r in out.collect()]


@pytest.mark.parametrize(
    ("a", "b", "lca"),
    [
        (T.BOOL, T.INT64, T.INT64),
        (T.INT64, T.FLOAT64, T.FLOAT64),
        (T.BOOL, T.FLOAT64, T.FLOAT64),
        (T.FLOAT64, T.TIMESTAMP, T.STRING),
        (T.TIMESTAMP, T.TIMESTAMP, T.TIMESTAMP),
        (T.INT64, T.STRING, T.STRING),
    ],
)
def test_lattice(a, b, lca):
    assert promote(a, b) == promote(b, a) == lca
    assert fits(a, lca) and fits(b, lca)


def test_parse_variant_schema_with_quoted_names():
    node = parse_schema("OBJECT<`a b`: BIGINT, c: OBJECT<`x``y`: DECIMAL(3,1)>, d: ARRAY<STRING>>")
    assert [n for n, _ in node.fields] == ["a b", "c", "d"]
    assert node.fields[1][1].fields[0] == ("x`y", parse_schema("DECIMAL(3,1)"))


def test_nested_objects_flatten_and_arrays_are_json(spark):
    f = fields_of(spark, [{"user": {"address": {"city": "Oslo"}, "age": 3}, "tags": ["a", 1]}])
    assert {p: (v.type, v.json_text) for p, v in f.items()} == {
        ("user", "address", "city"): (T.STRING, False),
        ("user", "age"): (T.INT64, False),
        ("tags",): (T.STRING, True),
    }
    _, rows = rows_of(spark, [{"user": {"address": {"city": "Oslo"}}, "tags": ["a", 1]}])
    assert rows == [{"user_address_city": "Oslo", "tags": '["a",1]'}]


def test_types_within_a_batch_take_the_common_ancestor(spark):
    f = fields_of(
        spark,
        [
            {"i": 1, "f": 1, "s": 1, "b": True, "t": "2024-05-01T12:00:00Z", "ts": "2024-05-01"},
            {"i": 2, "f": 2.5, "s": "x", "b": 3, "t": "2024-05-02 08:30:00.5+02:00", "ts": 1.5},
            {"n": None},
        ],
    )
    assert {p[0]: v.type for p, v in f.items()} == {
        "i": T.INT64,
        "f": T.FLOAT64,
        "s": T.STRING,
        "b": T.INT64,
        "t": T.TIMESTAMP,
        "ts": T.STRING,
    }  # n: null everywhere, no column


def test_projected_values_and_types(spark):
    schema, rows = rows_of(
        spark,
        [
            {"i": 1, "f": 1, "s": 1, "b": True, "t": "2024-05-01T12:00:00Z"},
            {"i": 2, "f": 2.5, "s": "x", "b": 3, "t": "2024-05-02T08:30:00.5+02:00"},
        ],
    )
    assert {c.name: c.type for c in schema.columns.values()} == {
        "i": T.INT64,
        "f": T.FLOAT64,
        "s": T.STRING,
        "b": T.INT64,
        "t": T.TIMESTAMP,
    }
    assert rows[0] == {"i": 1, "f": 1.0, "s": "1", "b": 1, "t": datetime(2024, 5, 1, 12, 0)}
    assert rows[1]["f"] == 2.5 and rows[1]["s"] == "x" and rows[1]["b"] == 3
    assert rows[1]["t"] == datetime(2024, 5, 2, 6, 30, 0, 500000)  # UTC (session time zone)


def test_objects_mixed_with_values_become_json_text(spark):
    _, rows = rows_of(spark, [{"x": {"y": 1}}, {"x": "plain"}])
    assert rows == [{"x": '{"y":1}'}, {"x": "plain"}]


def test_names_are_normalised_and_colliding_names_share_a_column(spark):
    schema, rows = rows_of(spark, [{"Page URL": "a"}, {"page_url": "b"}])
    assert list(schema.columns) == ["page_url"]
    assert rows == [{"page_url": "a"}, {"page_url": "b"}]


def test_values_that_do_not_fit_an_existing_column_go_to_a_typed_sibling(spark):
    existing = TableSchema("t", {"price": Column("price", T.INT64), "ok": Column("ok", T.BOOL)})
    schema, rows = rows_of(
        spark,
        [{"price": 3, "ok": True}, {"price": 9.5, "ok": 2}, {"price": "free", "ok": None}],
        existing,
    )
    assert {c.name: c.type for c in schema.columns.values()} == {
        "price": T.INT64,
        "price__string": T.STRING,
        "ok": T.BOOL,
        "ok__int64": T.INT64,
    }
    assert rows == [
        {"price": 3, "price__string": None, "ok": True, "ok__int64": None},
        {"price": None, "price__string": "9.5", "ok": None, "ok__int64": 2},
        {"price": None, "price__string": "free", "ok": None, "ok__int64": None},
    ]


def test_values_that_fit_an_existing_wider_column_are_converted(spark):
    existing = TableSchema("t", {"n": Column("n", T.FLOAT64), "s": Column("s", T.STRING)})
    schema, rows = rows_of(spark, [{"n": 1, "s": 2}, {"n": True, "s": False}], existing)
    assert {c.name: c.type for c in schema.columns.values()} == {"n": T.FLOAT64, "s": T.STRING}
    assert rows == [{"n": 1.0, "s": "2"}, {"n": 1.0, "s": "false"}]


def test_timestamp_column_takes_iso_text_and_keeps_other_text_apart(spark):
    existing = TableSchema("t", {"at": Column("at", T.TIMESTAMP)})
    _, rows = rows_of(spark, [{"at": "2024-05-01T00:00:00Z"}, {"at": "yesterday"}], existing)
    assert rows == [
        {"at": datetime(2024, 5, 1, 0, 0), "at__string": None},
        {"at": None, "at__string": "yesterday"},
    ]


def test_explicit_types_win(spark):
    schema, _ = rows_of(spark, [{"amount": 1}], explicit={("amount",): "DOUBLE"})
    assert schema.columns["amount"] == Column("amount", T.FLOAT64, "DOUBLE")


def test_timestamps_come_back_in_utc(spark):
    _, rows = rows_of(spark, [{"t": "2024-01-01T01:00:00+01:00"}])
    assert rows[0]["t"].replace(tzinfo=UTC) == datetime(2024, 1, 1, tzinfo=UTC)
