"""The pure steps on tiny DataFrames: decode, context, routing (templates), mapping."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import functions as F

from headwater.pipeline.columns import ERROR, EVENT, TABLE
from headwater.pipeline.config import MappingConfig
from headwater.pipeline.steps.context import enrich_context
from headwater.pipeline.steps.decode import INVALID_JSON, NOT_AN_OBJECT, RAW_FIELD, decode
from headwater.pipeline.steps.mapping import apply_mapping, explicit_types
from headwater.pipeline.steps.routing import TEMPLATE_FAILED, route
from headwater.pipeline.steps.template import TemplateError, compile_template
from headwater.testing.pipeline import batch


def events(df):
    return [
        None if r[0] is None else json.loads(r[0])
        for r in df.orderBy("offset").select(F.to_json(EVENT)).collect()
    ]


def errors(df):
    return [
        None if r[0] is None else (r[0]["code"], r[0]["reason"])
        for r in df.orderBy("offset").select(ERROR).collect()
    ]


def test_decode_json_objects_and_fails_what_is_not(spark):
    df = decode(batch(spark, [{"a": 1, "b": {"c": "x"}}, "not json", "[1, 2]", '  {"ok": true}']))
    assert events(df) == [{"a": 1, "b": {"c": "x"}}, None, None, {"ok": True}]
    errs = errors(df)
    assert errs[0] is None and errs[3] is None
    assert errs[1] == (INVALID_JSON, "the value is not valid JSON")
    assert errs[2] == (NOT_AN_OBJECT, "the JSON value is not an object but array")


def test_decode_keeps_other_bytes_as_base64(spark):
    df = decode(batch(spark, [b"\x00\xffraw"], content_type="application/octet-stream"))
    assert events(df) == [{RAW_FIELD: "AP9yYXc="}]
    assert errors(df) == [None]


def test_decode_unlabelled_json_is_parsed_and_unlabelled_text_is_raw(spark):
    df = decode(batch(spark, ['{"x": 1}', "hello", "{broken"], content_type=None))
    assert events(df) == [{"x": 1}, {RAW_FIELD: "aGVsbG8="}, {RAW_FIELD: "e2Jyb2tlbg=="}]
    assert errors(df) == [None, None, None]


def test_decode_json_in_raccoon_event_bytes(spark):
    df = decode(batch(spark, ['{"x": 1}'], content_type="application/x-protobuf"))
    assert events(df) == [{"x": 1}]


def test_context_fields_come_from_headers_and_win_over_the_client(spark):
    df = enrich_context(
        decode(
            batch(
                spark,
                [{"source_ip": "6.6.6.6", "event_type": "mine"}, {"x": 1}],
                headers={"user-agent": "curl/8"},
            )
        )
    )
    first, second = events(df)
    assert first["source_ip"] == "81.2.69.142"
    assert first["event_type"] == "mine"  # the event's own type is kept
    assert second["event_type"] == "track"  # else the header's
    assert second["api_key"] == "web" and second["src"] == "segment"
    assert second["eventn_ctx"] == {"event_id": "ev-1", "user_agent": "curl/8"}
    ts = df.orderBy("offset").select(F.col(EVENT)["_timestamp"])
    assert [str(r[0]) for r in ts.collect()] == ["2024-05-01 12:00:00"] * 2


def test_context_by_either_path_gives_the_same_event(spark):
    """Fields added to the JSON text (the fast path) or set one by one (the client sent a
    context field itself, or its own eventn_ctx object) give the same result."""
    values = [
        "{}",
        ' \n{ "a" : 1 }\t',
        {"a": 1, "note": 'says "eventn_ctx" and "event_type" in a value'},
        {"a": 1, "eventn_ctx": {"mine": True, "event_id": "client's"}},
        {"a": 1, "src": "client's"},
        {"a": 1, "event_type": "own"},
    ]
    got = events(enrich_context(decode(batch(spark, values, headers={"user-agent": "ua/1"}))))
    context = {
        "source_ip": "81.2.69.142",
        "api_key": "web",
        "src": "segment",
        "_timestamp": "2024-05-01T12:00:00.000Z",
    }
    assert got[0] == {
        **context,
        "event_type": "track",
        "eventn_ctx": {"event_id": "ev-0", "user_agent": "ua/1"},
    }
    assert got[1] == {**got[0], "a": 1, "eventn_ctx": {"event_id": "ev-1", "user_agent": "ua/1"}}
    assert got[2]["note"] == values[2]["note"] and got[2]["event_type"] == "track"
    assert got[2]["eventn_ctx"] == {"event_id": "ev-2", "user_agent": "ua/1"}
    assert got[3]["eventn_ctx"] == {"mine": True, "event_id": "ev-3", "user_agent": "ua/1"}
    assert got[4]["src"] == "segment" and got[4]["_timestamp"] == context["_timestamp"]
    assert got[5]["event_type"] == "own" and got[5]["source_ip"] == context["source_ip"]


def test_context_leaves_failed_rows_alone(spark):
    df = enrich_context(decode(batch(spark, ["nope"])))
    assert events(df) == [None]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("events", ["events", "events", "events"]),
        ("{{ event }}_x", ["signup_x", "Order Placed_x", None]),
        ("t_{{ event | slug | lower }}", ["t_signup", "t_order_placed", None]),
        ("{{ /properties/kind | default('none') }}", ["a", "none", "none"]),
        ("{{ $type }}_{{ $date }}", ["track_2024_05_01"] * 3),
        ("{{ skip | default('') }}", ["", "", ""]),
    ],
)
def test_routing_templates(spark, template, expected):
    df = batch(
        spark,
        [{"event": "signup", "properties": {"kind": "a"}}, {"event": "Order Placed"}, {"n": 1}],
    )
    out = route(enrich_context(decode(df)), template).orderBy("offset")
    assert [r[0] for r in out.select(TABLE).collect()] == expected
    for r, want in zip(out.select(ERROR).collect(), expected, strict=True):
        if want is None:
            assert r[0]["code"] == TEMPLATE_FAILED and "field event is missing" in r[0]["reason"]
        else:
            assert r[0] is None


def test_routing_refuses_objects(spark):
    out = route(decode(batch(spark, [{"user": {"id": 1}}])), "{{ user }}")
    assert "not a text or number" in out.select(ERROR).first()[0]["reason"]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ }}", "an empty"),
        ("a{{ x", "unbalanced"),
        ("{{ x | explode }}", "unknown filter"),
        ("{{ $nope }}", "unknown variable"),
        ("{{ a b }}", "neither a field path"),
    ],
)
def test_bad_templates_are_named(template, message):
    with pytest.raises(TemplateError, match=message):
        compile_template(template)


def test_mapping_rules_in_order(spark):
    mapping = MappingConfig.model_validate(
        {
            "fields": [
                {"src": "/user/id", "dst": "/user_id", "action": "move", "type": "text"},
                {"src": "/secret", "action": "remove"},
                {"src": "/amount", "action": "cast", "type": "numeric(10,2)"},
                {"dst": "/meta/version", "action": "constant", "value": 3},
            ]
        }
    )
    df = batch(spark, [{"user": {"id": 7, "name": "a"}, "secret": "s", "amount": 1}, {"x": 1}])
    out = events(apply_mapping(decode(df), mapping))
    assert out == [
        {"user": {"name": "a"}, "user_id": 7, "amount": 1, "meta": {"version": 3}},
        {"x": 1, "meta": {"version": 3}},
    ]
    assert explicit_types(mapping) == {("user_id",): "text", ("amount",): "numeric(10,2)"}


def test_mapping_keep_unmapped_false_keeps_only_named_fields(spark):
    mapping = MappingConfig.model_validate(
        {
            "keep_unmapped": False,
            "fields": [
                {"src": "/a", "dst": "/b", "action": "move"},
                {"src": "/c/d", "action": "cast", "type": "bigint"},
            ],
        }
    )
    df = batch(spark, [{"a": 1, "c": {"d": 2, "e": 3}, "z": 9}])
    assert events(apply_mapping(decode(df), mapping)) == [{"b": 1, "c": {"d": 2}}]


def test_mapping_config_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="needs type"):
        MappingConfig.model_validate({"fields": [{"src": "/a", "action": "cast"}]})
    with pytest.raises(ValueError, match="names no field"):
        MappingConfig.model_validate({"fields": [{"src": "/", "action": "remove"}]})
