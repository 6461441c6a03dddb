"""Jitsu's event APIs: the typed ``/api/s/{type}`` and the classic ``/api/v1/event``, with the
shapes Jitsu's SDKs and documentation send, and every bad input refused with its reason."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected
from headwater.collector.protocols.jitsu import decode_jitsu_classic, decode_jitsu_typed

LIMITS = LimitsConfig()

# What @jitsu/js sends to /api/s/{type} (Segment's shape, type in the path and the body).
JS_PAGE = {
    "type": "page",
    "messageId": "2fsd9ef0s8df0s9d8f",
    "anonymousId": "bKTtbVZw3yiqCJvCSJgjVeXp",
    "timestamp": "2023-04-12T13:29:04.690Z",
    "sentAt": "2023-04-12T13:29:04.690Z",
    "properties": {"title": "Pricing", "url": "https://example.com/pricing", "path": "/pricing"},
    "context": {
        "library": {"name": "@jitsu/js", "version": "1.9.0"},
        "userAgent": "Mozilla/5.0",
        "locale": "en-GB",
        "page": {"referrer": "$direct", "host": "example.com"},
    },
}
JS_TRACK = {
    "type": "track",
    "event": "testEvent",
    "properties": {"testProp": "test event properties"},
    "userId": "user@example.com",
    "anonymousId": "bKTtbVZw3yiqCJvCSJgjVeXp",
}

# What the classic JavaScript SDK sends to /api/v1/event?token=... (context flattened in).
CLASSIC = {
    "api_key": "js.client-key",
    "src": "jitsu",
    "event_type": "pageview",
    "event_id": "",
    "user": {"anonymous_id": "nd9x7s", "email": "ann@example.com"},
    "ids": {"ga": "GA1.2.3"},
    "user_agent": "Mozilla/5.0",
    "utc_time": "2021-06-08T09:51:02.510000Z",
    "local_tz_offset": -180,
    "url": "https://example.com/",
    "screen_resolution": "1440x900",
}


def _values(intake: Any) -> list[Any]:
    return [orjson.loads(e.value) for e in intake.events]


@pytest.mark.parametrize(("path", "etype"), [("page", "page"), ("p", "page"), ("event", "page")])
def test_typed_page_as_the_js_sdk_sends_it(path: str, etype: str) -> None:
    intake = decode_jitsu_typed(path, orjson.dumps(JS_PAGE), LIMITS)
    [event] = intake.events
    assert (event.type, event.key, event.content_type) == (
        etype,
        b"bKTtbVZw3yiqCJvCSJgjVeXp",
        "application/json",
    )
    assert orjson.loads(event.value) == JS_PAGE
    assert intake.meta == {}
    assert intake.request_id is None


def test_typed_track_keys_by_user_id_and_takes_the_write_key_out() -> None:
    body = {**JS_TRACK, "writeKey": "keyId:keySecret"}
    intake = decode_jitsu_typed("track", orjson.dumps(body), LIMITS)
    assert intake.events[0].key == b"user@example.com"
    assert intake.meta == {"write_key": "keyId:keySecret"}
    assert _values(intake) == [JS_TRACK]


@pytest.mark.parametrize(
    ("path", "etype"),
    [("i", "identify"), ("g", "group"), ("a", "alias"), ("s", "screen"), ("signup", "signup")],
)
def test_typed_paths_name_the_type(path: str, etype: str) -> None:
    [event] = decode_jitsu_typed(path, b'{"userId": 7, "traits": {}}', LIMITS).events
    assert (event.type, event.key) == (etype, b"7")


def test_typed_event_path_takes_a_custom_type_from_the_body() -> None:
    body = {"type": "checkout.started", "anonymousId": "a"}
    assert decode_jitsu_typed("e", orjson.dumps(body), LIMITS).events[0].type == "checkout.started"


def test_typed_without_ids_has_no_key() -> None:
    [event] = decode_jitsu_typed("page", b'{"properties": {}}', LIMITS).events
    assert event.key is None


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("page", b"", "body is empty"),
        ("page", b'{"type": "page",}', "body is not valid JSON: "),
        ("page", b"[]", "body must be one event as a JSON object, got array"),
        ("event", b'{"anonymousId": "a"}', '/api/s/event takes the type from the event\'s "type"'),
        ("event", b'{"type": 5}', '"type" is a number: it must be a word'),
        ("event", b'{"type": "a b"}', "\"type\" is 'a b': it must be a word"),
        ("track", b'{"userId": "u"}', 'a track event needs "event" (its name)'),
        ("t", b'{"event": ""}', "a track event needs \"event\" (its name), got ''"),
        (
            "event",
            b'{"type": "track", "event": {}}',
            'a track event needs "event" (its name), got an',
        ),
        ("page", b'{"writeKey": 12}', '"writeKey" must be a string, got number'),
    ],
)
def test_typed_bad_input(path: str, body: bytes, reason: str) -> None:
    with pytest.raises(Rejected) as info:
        decode_jitsu_typed(path, body, LIMITS)
    assert info.value.status == 400
    assert info.value.reason.startswith(reason), info.value.reason


@pytest.mark.parametrize("path", ["", "a/b", "x" * 65, "pägé"])
def test_typed_path_that_is_not_a_type(path: str) -> None:
    with pytest.raises(Rejected, match="does not name an event type") as info:
        decode_jitsu_typed(path, orjson.dumps(JS_PAGE), LIMITS)
    assert info.value.status == 404


def test_classic_event_from_the_js_sdk() -> None:
    intake = decode_jitsu_classic(orjson.dumps(CLASSIC), LIMITS)
    [event] = intake.events
    assert (event.type, event.key) == ("pageview", b"nd9x7s")
    assert intake.meta == {"write_key": "js.client-key"}
    expected = {k: v for k, v in CLASSIC.items() if k != "api_key"}
    assert orjson.loads(event.value) == expected


def test_classic_compat_format_keys_from_eventn_ctx() -> None:
    body = {
        "event_type": "app_page",
        "eventn_ctx": {"event_id": "e1", "user": {"id": "u-9", "anonymous_id": "a"}},
    }
    [event] = decode_jitsu_classic(orjson.dumps(body), LIMITS).events
    assert (event.type, event.key) == ("app_page", b"u-9")


def test_classic_array_from_the_mobile_api() -> None:
    body = [
        {**CLASSIC, "event_type": "user tapped purchase button", "user": {"id": "pzrW"}},
        {"src": "jitsu_ios", "event_type": "app entered background"},
        {"custom": 1},
    ]
    intake = decode_jitsu_classic(orjson.dumps(body), LIMITS)
    assert [e.type for e in intake.events] == [
        "user tapped purchase button",
        "app entered background",
        "event",
    ]
    assert [e.key for e in intake.events] == [b"pzrW", None, None]


def test_classic_template_fields_go_into_every_event_and_win() -> None:
    body = {
        "template": {"src": "jitsu_ios", "app_build_id": "2.1.1", "user": {"id": "u1"}},
        "events": [
            {"event_type": "a", "custom_param_1": "chips"},
            {"event_type": "b", "src": "mine", "user": {"id": "u2"}},
        ],
    }
    values = _values(decode_jitsu_classic(orjson.dumps(body), LIMITS))
    assert values[0] == {
        "event_type": "a",
        "custom_param_1": "chips",
        "src": "jitsu_ios",
        "app_build_id": "2.1.1",
        "user": {"id": "u1"},
    }
    assert values[1]["src"] == "jitsu_ios"
    assert values[1]["user"] == {"id": "u1"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "body is empty"),
        (b"{", "body is not valid JSON"),
        (b"[]", "body is an empty array: send at least one event"),
        (b'"event"', "body must be an event object or an array of them, got string"),
        (b'[{"event_type": "a"}, 3]', "[1]: an event must be a JSON object, got number"),
        (b'[{"event_type": ["a"]}]', '[0]: "event_type" must be a string, got array'),
        (b'{"event_type": 1}', '"event_type" must be a string, got number'),
        (b'{"template": [], "events": [{}]}', '"template" must be an object, got array'),
        (b'{"template": {}, "events": {}}', '"events" must be an array of events, got object'),
        (b'{"template": {}, "events": []}', '"events" is empty: send at least one event'),
        (b'{"template": {}, "events": [{}, null]}', "events[1]: an event must be a JSON object"),
        (b'[{"api_key": "a"}, {"api_key": "b"}]', '[1]: "api_key" differs from the one given'),
        (b'{"api_key": 5}', '"api_key" must be a string, got number'),
    ],
)
def test_classic_bad_input(body: bytes, reason: str) -> None:
    with pytest.raises(Rejected) as info:
        decode_jitsu_classic(body, LIMITS)
    assert info.value.status == 400
    assert info.value.reason.startswith(reason), info.value.reason


def test_classic_too_many_events() -> None:
    with pytest.raises(Rejected) as info:
        decode_jitsu_classic(b"[{}, {}, {}]", LimitsConfig(max_batch_events=2))
    assert info.value.status == 413
    assert info.value.reason == "body has 3 events, more than 2 (collector.limits.max_batch_events)"
