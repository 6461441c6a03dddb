"""Flattening, type inference and promotion, and the never-lose-a-value rule against existing
columns, on tiny batches run in-process (as a Spark task runs them)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from headwater.destinations import open_destination
from headwater.destinations.base import Column, TableSchema
from headwater.destinations.types import ColumnType as T
from headwater.destinations.types import fits, promote
from headwater.pipeline import shape as sh
from headwater.pipeline.config import DestinationConfig
from headwater.testing.pipeline import process, source_table

CONTEXT = {"source_ip", "api_key", "src", "_timestamp", "event_type"}


def own(row):
    return {k: v for k, v in row.items() if k not in CONTEXT and not k.startswith("eventn_ctx")}


def typed(tmp_path, values, existing=None, mapping=None):
    """(column -> type of the table as planned, rows without the context columns)."""
    dest = {"mapping": mapping} if mapping else {}
    if existing is not None:
        spec = DestinationConfig(id="wh", type="duckdb", path=tmp_path / "wh.duckdb")
        with open_destination(spec, tmp_path) as d:
            d.ensure_table(existing)
    done = process(source_table(values), dest, path=tmp_path)
    schema = done.plan.tables["events"].schema
    types = {c.name: c.type for c in schema.columns.values() if c.name in own(schema.columns)}
    return types, [own(r) for r in done.rows()], schema


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


def test_shapes_merge_leaves_and_objects_into_json():
    shape = sh.Shape()
    shape.merge(sh.infer_texts(['{"a": {"b": 1}, "n": 1, "t": "2024-05-01T00:00:00Z"}']))
    assert shape.leaves[("a", "b")].kinds == {sh.INT64}
    assert shape.leaves[("t",)].is_timestamp
    shape.merge(sh.infer_texts(['{"a": "flat", "n": 1.5, "t": "soon"}']))
    assert ("a", "b") not in shape.leaves and shape.leaves[("a",)].kinds == {sh.JSON, sh.STRING}
    assert shape.leaves[("n",)].kinds == {sh.INT64, sh.FLOAT64}
    assert not shape.leaves[("t",)].is_timestamp


def test_nested_objects_flatten_and_arrays_are_json(tmp_path):
    types, rows, _ = typed(
        tmp_path, [{"user": {"address": {"city": "Oslo"}, "age": 3}, "tags": ["a", 1]}]
    )
    assert types == {"user_address_city": T.STRING, "user_age": T.INT64, "tags": T.STRING}
    assert rows == [{"user_address_city": "Oslo", "user_age": 3, "tags": '["a",1]'}]


def test_types_within_a_batch_take_the_common_ancestor(tmp_path):
    types, _, _ = typed(
        tmp_path,
        [
            {"i": 1, "f": 1, "s": 1, "b": True, "t": "2024-05-01T12:00:00Z", "ts": "2024-05-01"},
            {"i": 2, "f": 2.5, "s": "x", "b": 3, "t": "2024-05-02 08:30:00.5+02:00", "ts": 1.5},
            {"n": None},
        ],
    )
    assert types == {
        "i": T.INT64,
        "f": T.FLOAT64,
        "s": T.STRING,
        "b": T.INT64,
        "t": T.TIMESTAMP,
        "ts": T.STRING,
    }  # n: null everywhere, no column


def test_projected_values_and_types(tmp_path):
    _, rows, _ = typed(
        tmp_path,
        [
            {"i": 1, "f": 1, "s": 1, "b": True, "t": "2024-05-01T12:00:00Z"},
            {"i": 2, "f": 2.5, "s": "x", "b": 3, "t": "2024-05-02T08:30:00.5+02:00"},
        ],
    )
    utc = UTC
    assert rows[0] == {
        "i": 1,
        "f": 1.0,
        "s": "1",
        "b": 1,
        "t": datetime(2024, 5, 1, 12, 0, tzinfo=utc),
    }
    assert rows[1]["f"] == 2.5 and rows[1]["s"] == "x" and rows[1]["b"] == 3
    assert rows[1]["t"] == datetime(2024, 5, 2, 6, 30, 0, 500000, tzinfo=utc)


def test_objects_mixed_with_values_become_json_text(tmp_path):
    _, rows, _ = typed(tmp_path, [{"x": {"y": 1}}, {"x": "plain"}])
    assert rows == [{"x": '{"y":1}'}, {"x": "plain"}]


def test_names_are_normalised_and_colliding_names_share_a_column(tmp_path):
    types, rows, _ = typed(tmp_path, [{"Page URL": "a"}, {"page_url": "b"}])
    assert list(types) == ["page_url"]
    assert rows == [{"page_url": "a"}, {"page_url": "b"}]


def test_values_that_do_not_fit_an_existing_column_go_to_a_typed_sibling(tmp_path):
    existing = TableSchema(
        "events", {"price": Column("price", T.INT64), "ok": Column("ok", T.BOOL)}
    )
    types, rows, _ = typed(
        tmp_path,
        [{"price": 3, "ok": True}, {"price": 9.5, "ok": 2}, {"price": "free", "ok": None}],
        existing,
    )
    assert types == {
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


def test_values_that_fit_an_existing_wider_column_are_converted(tmp_path):
    existing = TableSchema("events", {"n": Column("n", T.FLOAT64), "s": Column("s", T.STRING)})
    types, rows, _ = typed(tmp_path, [{"n": 1, "s": 2}, {"n": True, "s": False}], existing)
    assert types == {"n": T.FLOAT64, "s": T.STRING}
    assert rows == [{"n": 1.0, "s": "2"}, {"n": 1.0, "s": "false"}]


def test_timestamp_column_takes_iso_text_and_keeps_other_text_apart(tmp_path):
    existing = TableSchema("events", {"at": Column("at", T.TIMESTAMP)})
    _, rows, _ = typed(tmp_path, [{"at": "2024-05-01T00:00:00Z"}, {"at": "yesterday"}], existing)
    assert rows == [
        {"at": datetime(2024, 5, 1, 0, 0, tzinfo=UTC), "at__string": None},
        {"at": None, "at__string": "yesterday"},
    ]


def test_explicit_types_win(tmp_path):
    _, _, schema = typed(
        tmp_path,
        [{"amount": 1}],
        mapping={"fields": [{"src": "/amount", "action": "cast", "type": "DOUBLE"}]},
    )
    assert schema.columns["amount"] == Column("amount", T.FLOAT64, "DOUBLE")


def test_timestamps_come_back_in_utc(tmp_path):
    _, rows, _ = typed(tmp_path, [{"t": "2024-01-01T01:00:00+01:00"}])
    assert rows[0]["t"] == datetime(2024, 1, 1, tzinfo=UTC)


def test_a_value_of_a_kind_the_shape_lacks_is_novel_and_learned(tmp_path):
    """A later batch's float in a column of ints is noticed, not rounded: the shape learns it
    and the value keeps its own type."""
    first = process(source_table([{"n": 1}, {"n": 2}]), path=tmp_path)
    assert first.knowledge.shape.leaves[("n",)].kinds == {sh.INT64}
    later = process(source_table([{"n": 3}, {"n": 1.5}]), path=tmp_path, knowledge=first.knowledge)
    assert later.knowledge.shape.leaves[("n",)].kinds == {sh.INT64, sh.FLOAT64}
    assert [r["n"] for r in later.rows()] == [3.0, 1.5]
