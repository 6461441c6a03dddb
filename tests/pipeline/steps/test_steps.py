"""The steps on tiny batches, run as a Spark task runs them (in-process, no Spark): decode,
context, routing (templates), mapping. Each event is observed as the archive keeps it (its
JSON after every step)."""

from __future__ import annotations

import pytest

from headwater.pipeline.config import MappingConfig
from headwater.pipeline.steps.decode import INVALID_JSON, NOT_AN_OBJECT, RAW_FIELD
from headwater.pipeline.steps.mapping import explicit_types
from headwater.pipeline.steps.routing import TEMPLATE_FAILED
from headwater.pipeline.steps.template import TemplateError, compile_template
from headwater.testing.pipeline import events_after_steps, source_table

CONTEXT = ("source_ip", "api_key", "src", "_timestamp", "eventn_ctx", "event_type")


def own(event):
    """The event without the context fields."""
    return None if event is None else {k: v for k, v in event.items() if k not in CONTEXT}


def test_decode_json_objects_and_fails_what_is_not(tmp_path):
    events, errors = events_after_steps(
        source_table([{"a": 1, "b": {"c": "x"}}, "not json", "[1, 2]", '  {"ok": true}']),
        tmp_path,
    )
    assert [own(e) for e in events] == [{"a": 1, "b": {"c": "x"}}, None, None, {"ok": True}]
    assert errors == {
        1: (INVALID_JSON, "the value is not valid JSON"),
        2: (NOT_AN_OBJECT, "the JSON value is not an object but array"),
    }


def test_malformed_json_that_looks_like_an_object_fails_alone(tmp_path):
    events, errors = events_after_steps(
        source_table([{"a": 1}, '{"a": 2', '{"a": 3}', '{"a": 4} trailing']), tmp_path
    )
    assert [own(e) for e in events] == [{"a": 1}, None, {"a": 3}, None]
    assert errors == {1: (INVALID_JSON, "the value is not valid JSON")} | {
        3: (INVALID_JSON, "the value is not valid JSON")
    }


def test_json_labelled_bytes_that_are_not_utf8_fail(tmp_path):
    _, errors = events_after_steps(source_table([b'{"a": "\xff"}', {"a": 1}]), tmp_path)
    assert errors == {0: (INVALID_JSON, "the value is not valid JSON")}


def test_decode_keeps_other_bytes_as_base64(tmp_path):
    events, errors = events_after_steps(
        source_table([b"\x00\xffraw"], content_type="application/octet-stream"), tmp_path
    )
    assert own(events[0]) == {RAW_FIELD: "AP9yYXc="}
    assert errors == {}


def test_decode_unlabelled_json_is_parsed_and_unlabelled_text_is_raw(tmp_path):
    events, _ = events_after_steps(
        source_table(['{"x": 1}', "hello", "{broken"], content_type=None), tmp_path
    )
    assert [own(e) for e in events] == [
        {"x": 1},
        {RAW_FIELD: "aGVsbG8="},
        {RAW_FIELD: "e2Jyb2tlbg=="},
    ]


def test_decode_json_in_raccoon_event_bytes(tmp_path):
    events, _ = events_after_steps(
        source_table(['{"x": 1}'], content_type="application/x-protobuf"), tmp_path
    )
    assert own(events[0]) == {"x": 1}


def test_context_fields_come_from_headers_and_win_over_the_client(tmp_path):
    events, _ = events_after_steps(
        source_table(
            [{"source_ip": "6.6.6.6", "event_type": "mine"}, {"x": 1}],
            headers={"user-agent": "curl/8"},
        ),
        tmp_path,
    )
    first, second = events
    assert first["source_ip"] == "81.2.69.142"
    assert first["event_type"] == "mine"  # the event's own type is kept
    assert second["event_type"] == "track"  # else the header's
    assert second["api_key"] == "web" and second["src"] == "segment"
    assert second["eventn_ctx"] == {"event_id": "ev-1", "user_agent": "curl/8"}
    assert first["_timestamp"] == second["_timestamp"] == "2024-05-01T12:00:00.000000Z"


def test_context_keeps_the_clients_other_fields_and_fills_what_headers_lack(tmp_path):
    values = [
        {"a": 1, "eventn_ctx": {"mine": True, "event_id": "client's"}},
        {"a": 1, "src": "client's"},
        {"a": 1, "note": 'says "eventn_ctx" and "event_type" in a value'},
    ]
    events, _ = events_after_steps(
        source_table(values, headers={"user-agent": "ua/1", "protocol": None}), tmp_path
    )
    assert events[0]["eventn_ctx"] == {"mine": True, "event_id": "ev-0", "user_agent": "ua/1"}
    assert events[1]["src"] == "client's"  # no protocol header: the client's value stays
    assert events[2]["note"] == values[2]["note"] and events[2]["event_type"] == "track"


def test_a_clients_eventn_ctx_that_is_not_an_object_is_replaced(tmp_path):
    events, _ = events_after_steps(source_table([{"a": 1, "eventn_ctx": "a string"}]), tmp_path)
    assert events[0]["eventn_ctx"]["event_id"] == "ev-0"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("events", ["events", "events", "events"]),
        ("{{ event }}_x", ["signup_x", "Order Placed_x", None]),
        ("t_{{ event | slug | lower }}", ["t_signup", "t_order_placed", None]),
        ("{{ /properties/kind | default('none') }}", ["a", "none", "none"]),
        ("{{ $type }}_{{ $date }}", ["track_2024_05_01"] * 3),
        ("{{ skip | default('') }}", [None, None, None]),
    ],
)
def test_routing_templates(tmp_path, template, expected):
    from headwater.testing.pipeline import process

    source = source_table(
        [{"event": "signup", "properties": {"kind": "a"}}, {"event": "Order Placed"}, {"n": 1}]
    )
    done = process(source, {"table_name_template": template}, path=tmp_path)
    tables = {r["eventn_ctx_event_id"]: name for name, rows in done.tables.items() for r in rows}
    assert [tables.get(f"ev-{i}") for i in range(3)] == [
        None if e is None else e.lower().replace(" ", "_") for e in expected
    ]
    errors = done.errors()
    for i, want in enumerate(expected):
        if want is None and "skip" not in template:
            assert errors[i][0] == TEMPLATE_FAILED and "field event is missing" in errors[i][1]
        else:
            assert i not in errors
    assert done.summary.skipped == (3 if "skip" in template else 0)


def test_routing_refuses_objects(tmp_path):
    from headwater.testing.pipeline import process

    done = process(
        source_table([{"user": {"id": 1}}]), {"table_name_template": "{{ user }}"}, path=tmp_path
    )
    assert "not a text or number" in done.errors()[0][1]


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


def test_mapping_rules_in_order(tmp_path):
    mapping = {
        "fields": [
            {"src": "/user/id", "dst": "/user_id", "action": "move", "type": "text"},
            {"src": "/secret", "action": "remove"},
            {"src": "/amount", "action": "cast", "type": "numeric(10,2)"},
            {"dst": "/meta/version", "action": "constant", "value": 3},
        ]
    }
    source = source_table([{"user": {"id": 7, "name": "a"}, "secret": "s", "amount": 1}, {"x": 1}])
    events, _ = events_after_steps(source, tmp_path, mapping=mapping)
    assert [own(e) for e in events] == [
        {"user": {"name": "a"}, "user_id": 7, "amount": 1, "meta": {"version": 3}},
        {"x": 1, "meta": {"version": 3}},
    ]
    assert explicit_types(MappingConfig.model_validate(mapping)) == {
        ("user_id",): "text",
        ("amount",): "numeric(10,2)",
    }


def test_a_move_onto_a_field_replaces_it_only_where_the_source_has_a_value(tmp_path):
    mapping = {"fields": [{"src": "/new", "dst": "/old", "action": "move"}]}
    source = source_table([{"new": {"a": 1}, "old": "x"}, {"old": "y"}, {"new": "z", "old": 5}])
    events, _ = events_after_steps(source, tmp_path, mapping=mapping)
    assert [own(e) for e in events] == [{"old": {"a": 1}}, {"old": "y"}, {"old": "z"}]


def test_mapping_keep_unmapped_false_keeps_only_named_fields(tmp_path):
    mapping = {
        "keep_unmapped": False,
        "fields": [
            {"src": "/a", "dst": "/b", "action": "move"},
            {"src": "/c/d", "action": "cast", "type": "bigint"},
        ],
    }
    events, _ = events_after_steps(
        source_table([{"a": 1, "c": {"d": 2, "e": 3}, "z": 9}]), tmp_path, mapping=mapping
    )
    assert events == [None]  # no event id kept either: the event is only b and c.d
    from headwater.testing.pipeline import process

    done = process(
        source_table([{"a": 1, "c": {"d": 2, "e": 3}, "z": 9}]), {"mapping": mapping}, path=tmp_path
    )
    assert done.rows() == [{"b": 1, "c_d": 2}]


def test_mapping_config_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="needs type"):
        MappingConfig.model_validate({"fields": [{"src": "/a", "action": "cast"}]})
    with pytest.raises(ValueError, match="names no field"):
        MappingConfig.model_validate({"fields": [{"src": "/", "action": "remove"}]})
