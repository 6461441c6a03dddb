"""The Segment HTTP Tracking API decoder: what analytics-python really sends, decoded unmodified;
Segment's merge rules; every bad input refused with a reason naming it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
from segment.analytics.client import Client
from segment.analytics.request import APIError

from headwater.collector.auth import key_from_headers
from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected, bad_request
from headwater.collector.protocols.body import decode_body
from headwater.collector.protocols.segment import SUCCESS_BODY, decode_segment, error_body

LIMITS = LimitsConfig()
Request = tuple[str, dict[str, str], bytes]


@contextmanager
def recording_server(
    answer: Callable[[Request], tuple[int, bytes]] = lambda r: (200, SUCCESS_BODY),
) -> Iterator[tuple[str, list[Request]]]:
    """A local HTTP server recording every POST (path, lower-cased headers, body)."""
    seen: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            request = (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            seen.append(request)
            status, payload = answer(request)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _decode(request: Request, limits: LimitsConfig = LIMITS) -> Any:
    path, headers, raw = request
    body = decode_body(raw, headers.get("content-encoding"), limits.max_body_bytes)
    return decode_segment(path.rsplit("/", 1)[-1], body, limits)


def _as_sent(msg: dict[str, Any]) -> Any:
    """A message as the SDK serialises it (json.dumps, datetimes as ISO strings)."""
    return json.loads(json.dumps(msg, default=lambda o: o.isoformat()))


def _reject(kind: str, body: Any, limits: LimitsConfig = LIMITS) -> Rejected:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(Rejected) as info:
        decode_segment(kind, raw, limits)
    return info.value


def test_analytics_python_calls_are_delivered_unmodified() -> None:
    with recording_server() as (url, seen):
        client = Client("wk-python", host=url, sync_mode=True)
        when = datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
        sent = [
            client.track("u-1", "Order Completed", {"total": 12.5, "items": ["a", "b"]})[1],
            client.identify("u-1", {"email": "ann@example.com", "age": 41}, timestamp=when)[1],
            client.page(anonymous_id="anon-9", category="Docs", name="Intro")[1],
            client.screen("u-2", name="Home", properties={"dark": True})[1],
            client.group("u-1", "g-7", {"name": "Acme"}, context={"ip": "10.0.0.1"})[1],
            client.alias("anon-9", "u-1")[1],
            client.track(user_id=42, event="numeric id", properties={"ünï": "cödé ✓"})[1],
        ]
    assert len(seen) == len(sent)
    for request, msg in zip(seen, sent, strict=True):
        path, headers, _ = request
        assert path == "/v1/batch"
        assert key_from_headers(headers) == "wk-python"  # Basic auth, write key as user
        intake = _decode(request)
        assert intake.meta["write_key"] == "wk-python"
        assert intake.meta["sent_at"]
        assert intake.request_id is None
        [event] = intake.events
        assert event.type == msg["type"]
        assert event.content_type == "application/json"
        assert orjson.loads(event.value) == _as_sent(msg)
        assert event.key == (msg.get("userId") or msg.get("anonymousId")).encode()
    assert orjson.loads(_decode(seen[-1]).events[0].value)["properties"] == {"ünï": "cödé ✓"}


def test_analytics_python_gzip_batches_are_delivered_in_order() -> None:
    with recording_server() as (url, seen):
        client = Client("wk-batch", host=url, gzip=True, upload_size=100, upload_interval=0.01)
        sent = [
            client.track(f"user-{i % 7}", "Clicked", {"n": i, "pi": 3.14159})[1] for i in range(250)
        ]
        client.flush()  # waits until the consumer has uploaded the whole queue
        client.shutdown()
    assert all(headers.get("content-encoding") == "gzip" for _, headers, _ in seen)
    events = [e for request in seen for e in _decode(request).events]
    assert [orjson.loads(e.value) for e in events] == [_as_sent(m) for m in sent]
    assert max(len(_decode(r).events) for r in seen) <= 100
    assert {e.key for e in events} == {f"user-{i}".encode() for i in range(7)}


def test_analytics_python_reads_our_refusal() -> None:
    refusal = bad_request('batch[0]: a track call needs "event" (its name)', kind="bad_event")
    with recording_server(lambda r: (400, error_body(refusal))) as (url, _):
        client = Client("wk", host=url, sync_mode=True)
        with pytest.raises(APIError) as info:
            client.track("u", "Anything")
    assert info.value.status == 400
    assert info.value.code == "bad_event"
    assert info.value.message == refusal.reason


def test_single_calls_take_their_type_from_the_path_and_keep_the_event_as_sent() -> None:
    body = {"userId": "u", "event": "Signed Up", "properties": {"plan": "pro"}}
    [event] = decode_segment("track", orjson.dumps(body), LIMITS).events
    assert event.type == "track"
    assert orjson.loads(event.value) == body  # no "type" added
    [event] = decode_segment("identify", orjson.dumps({**body, "type": "identify"}), LIMITS).events
    assert event.type == "identify"


@pytest.mark.parametrize(
    ("kind", "call"),
    [("t", "track"), ("p", "page"), ("i", "identify"), ("s", "screen"), ("g", "group")],
)
def test_analytics_js_one_letter_paths(kind: str, call: str) -> None:
    body = {"type": call, "anonymousId": "a", "event": "e", "groupId": "g", "writeKey": "wk-js"}
    intake = decode_segment(kind, orjson.dumps(body), LIMITS)
    assert intake.events[0].type == call
    assert intake.meta == {"write_key": "wk-js"}
    assert "writeKey" not in orjson.loads(intake.events[0].value)


def test_analytics_js_batches_with_the_write_key_in_every_event() -> None:
    batch = [
        {"type": "page", "anonymousId": "a1", "writeKey": "wk-js", "_metadata": {"bundled": []}},
        {"type": "track", "event": "x", "anonymousId": "a1", "writeKey": "wk-js"},
    ]
    body = {"writeKey": "wk-js", "batch": batch, "sentAt": "2024-05-01T00:00:00.000Z"}
    for kind in ("b", "batch", "import"):
        intake = decode_segment(kind, orjson.dumps(body), LIMITS)
        assert intake.meta == {"write_key": "wk-js", "sent_at": "2024-05-01T00:00:00.000Z"}
        values = [orjson.loads(e.value) for e in intake.events]
        assert values[0] == {"type": "page", "anonymousId": "a1", "_metadata": {"bundled": []}}
        assert all("writeKey" not in v for v in values)


def test_batch_context_and_integrations_merge_into_each_event_the_events_own_keys_winning() -> None:
    body = {
        "context": {"ip": "1.2.3.4", "library": {"name": "batcher"}},
        "integrations": {"All": False},
        "batch": [
            {"type": "track", "event": "a", "userId": "u"},
            {"type": "track", "event": "b", "userId": "u", "context": {"ip": "5.6.7.8"}},
            {"type": "identify", "userId": "u", "integrations": {"Mixpanel": True}},
        ],
    }
    intake = decode_segment("batch", orjson.dumps(body), LIMITS)
    values = [orjson.loads(e.value) for e in intake.events]
    assert values[0]["context"] == {"ip": "1.2.3.4", "library": {"name": "batcher"}}
    assert values[1]["context"] == {"ip": "5.6.7.8", "library": {"name": "batcher"}}
    assert values[2]["integrations"] == {"All": False, "Mixpanel": True}
    assert values[0]["integrations"] == {"All": False}
    assert "sentAt" not in values[0]


def test_events_are_kept_byte_for_byte_in_compact_form() -> None:
    event = b'{"type":"track","event":"\xc3\xa9t\xc3\xa9","userId":"u","n":1.5,"z":{"b":1,"a":2}}'
    body = b'{ "batch" : [ ' + event + b" ] }"
    [decoded] = decode_segment("batch", body, LIMITS).events
    assert decoded.value == event


@pytest.mark.parametrize(
    ("ids", "key"),
    [
        ({"userId": "u", "anonymousId": "a"}, b"u"),
        ({"anonymousId": "a"}, b"a"),
        ({"userId": "", "anonymousId": "a"}, b"a"),
        ({"userId": 42}, b"42"),
        ({"userId": None, "anonymousId": 7.5}, b"7.5"),
    ],
)
def test_partition_key_is_the_user_id_else_the_anonymous_id(
    ids: dict[str, Any], key: bytes
) -> None:
    body = {"batch": [{"type": "identify", **ids}]}
    assert decode_segment("batch", orjson.dumps(body), LIMITS).events[0].key == key


TRACK = {"type": "track", "event": "e", "userId": "u"}


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        ("batch", b"", "body is empty"),
        ("batch", b"{batch:[]}", "body is not valid JSON: "),
        ("batch", b'{"batch":[{"type":"track","event":"e","userId":NaN}]}', "body is not valid"),
        ("batch", b'{"batch":[{"type":"track","event":"\xc0","userId":"u"}]}', "body is not valid"),
        ("batch", [TRACK], "body must be a JSON object, got array"),
        ("track", "just a string", "body must be a JSON object, got string"),
        ("batch", {"events": [TRACK]}, 'body has no "batch" array of events'),
        ("batch", {"batch": {"0": TRACK}}, '"batch" must be an array of events, got object'),
        ("batch", {"batch": []}, '"batch" is empty: send at least one event'),
        ("batch", {"batch": [TRACK, "x"]}, "batch[1]: an event must be a JSON object, got string"),
        ("batch", {"batch": [{"event": "e", "userId": "u"}]}, 'batch[0]: "type" is missing'),
        ("batch", {"batch": [{**TRACK, "type": "trak"}]}, "batch[0]: \"type\" is 'trak', not one"),
        ("batch", {"batch": [{**TRACK, "type": ["track"]}]}, 'batch[0]: "type" is an array, not'),
        ("track", {**TRACK, "type": "page"}, "\"type\" is 'page' but the call is /v1/track"),
        ("batch", {"batch": [{"type": "page"}]}, 'batch[0]: a page call needs a "userId" or an'),
        ("page", {"userId": "", "anonymousId": ""}, 'a page call needs a "userId" or an "anony'),
        ("page", {"userId": {"id": 1}}, '"userId" must be a string or a number, got object'),
        ("page", {"anonymousId": True}, '"anonymousId" must be a string or a number, got bool'),
        ("batch", {"batch": [TRACK, {**TRACK, "event": None}]}, 'batch[1]: a track call needs "e'),
        ("track", {**TRACK, "event": ""}, 'a track call needs "event" (its name)'),
        ("track", {**TRACK, "event": 5}, 'a track call needs "event" (its name), got a number'),
        ("group", {"userId": "u"}, 'a group call needs "groupId" (the group\'s id)'),
        ("alias", {"userId": "u"}, 'an alias call needs "previousId" (the user\'s old id)'),
        ("batch", {"batch": [TRACK], "context": "web"}, '"context" must be an object, got string'),
        ("batch", {"batch": [TRACK], "integrations": [1]}, '"integrations" must be an object, got'),
        (
            "batch",
            {"batch": [{**TRACK, "context": 3}], "context": {"ip": "x"}},
            'batch[0]: "context" must be an object, got number',
        ),
        (
            "batch",
            {"batch": [TRACK], "sentAt": 17},
            '"sentAt" must be an ISO-8601 time string, got',
        ),
        ("batch", {"batch": [TRACK], "sentAt": "9" * 65}, '"sentAt" must be an ISO-8601 time'),
        ("batch", {"batch": [TRACK], "writeKey": 17}, '"writeKey" must be a string, got number'),
        (
            "batch",
            {"batch": [{**TRACK, "writeKey": "other"}], "writeKey": "wk"},
            'batch[0]: "writeKey" differs from the one given earlier in the request',
        ),
    ],
)
def test_bad_input_is_refused_with_a_precise_reason(kind: str, body: Any, reason: str) -> None:
    err = _reject(kind, body)
    assert err.status == 400
    assert err.reason.startswith(reason), err.reason


def test_too_many_events() -> None:
    err = _reject("batch", {"batch": [TRACK] * 4}, LimitsConfig(max_batch_events=3))
    assert err.status == 413
    assert err.reason == ('"batch" has 4 events, more than 3 (collector.limits.max_batch_events)')
    assert len(decode_segment("batch", orjson.dumps({"batch": [TRACK] * 3}), LIMITS).events) == 3


def test_an_unknown_call() -> None:
    err = _reject("purchase", TRACK)
    assert err.status == 404
    assert err.reason.startswith("/v1/purchase is not a Segment call")


def test_nesting_too_deep_to_store_is_refused_naming_the_event() -> None:
    deep = b'{"d":' * 300 + b"1" + b"}" * 300  # orjson reads it, cannot write it back
    track = orjson.dumps(TRACK)[:-1] + b',"properties":' + deep + b"}"
    err = _reject("batch", b'{"batch":[' + orjson.dumps(TRACK) + b"," + track + b"]}")
    assert err.reason.startswith("batch[1]: cannot be stored: "), err.reason
