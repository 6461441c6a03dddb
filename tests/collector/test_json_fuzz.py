"""Fuzzing the JSON-API decoders (Segment, Jitsu, OTLP) and the body reader: over 100k malformed
inputs (random bytes, truncated and mutated valid bodies, wrong types, deep nesting, huge
numbers, corrupt and bomb gzip bodies). The only acceptable outcomes are a valid ``Intake`` or a
``Rejected`` with a short reason and a client-error status; anything else is a bug."""

from __future__ import annotations

import gzip
import random
import zlib
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols.body import decode_body
from headwater.collector.protocols.jitsu import decode_jitsu_classic, decode_jitsu_typed
from headwater.collector.protocols.otlp import decode_otlp_logs
from headwater.collector.protocols.segment import decode_segment

LIMITS = LimitsConfig(max_body_bytes=1 << 20, max_batch_events=500)
PROTO = "application/x-protobuf"

# How many inputs each test throws; together well over 100k.
PLAN = {
    "byte_mutations": 45_000,
    "structural_mutations": 30_000,
    "otlp_protobuf_mutations": 15_000,
    "otlp_json_mutations": 4_000,
    "random_bytes": 8_000,
    "compressed_mutations": 3_000,
    "hypothesis_json": 2_000,
    "hypothesis_bytes": 1_500,
    "hypothesis_valid_batches": 250,
}

Decoder = Callable[[bytes], Intake]

JSON_DECODERS: list[tuple[str, Decoder]] = [
    ("segment batch", lambda b: decode_segment("batch", b, LIMITS)),
    *[
        (f"segment {k}", lambda b, k=k: decode_segment(k, b, LIMITS))
        for k in ("track", "identify", "page", "screen", "group", "alias", "t")
    ],
    *[
        (f"jitsu {k}", lambda b, k=k: decode_jitsu_typed(k, b, LIMITS))
        for k in ("page", "track", "event", "e", "custom")
    ],
    ("jitsu classic", lambda b: decode_jitsu_classic(b, LIMITS)),
    ("otlp json", lambda b: decode_otlp_logs(b, "application/json", LIMITS)),
]
OTLP_PROTO: Decoder = lambda b: decode_otlp_logs(b, PROTO, LIMITS)  # noqa: E731
OTLP_JSON: Decoder = JSON_DECODERS[-1][1]
ALL_DECODERS = [*JSON_DECODERS, ("otlp protobuf", OTLP_PROTO)]


def check(decoder: Decoder, body: bytes) -> Intake | Rejected:
    """Run ``decoder``; fail the test unless it returns a sound Intake or raises Rejected."""
    try:
        intake = decoder(body)
    except Rejected as e:
        assert e.status in (400, 404, 413, 415), (e.status, e.reason)
        assert isinstance(e.reason, str) and 0 < len(e.reason) <= 500, e.reason
        return e
    except Exception as e:  # pragma: no cover - the failure report
        pytest.fail(f"{type(e).__name__}: {e} for input {body[:300]!r}")
    assert isinstance(intake, Intake)
    assert intake.request_id is None
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in intake.meta.items())
    assert len(intake.events) <= LIMITS.max_batch_events
    for event in intake.events:
        assert isinstance(event, EventIn)
        assert isinstance(event.type, str) and event.type
        assert event.content_type == "application/json"
        assert event.key is None or isinstance(event.key, bytes)
        assert isinstance(orjson.loads(event.value), dict)
    return intake


# --- seeds: valid bodies as the SDKs send them -------------------------------------------------

TRACK = {
    "type": "track",
    "event": "Order Completed",
    "userId": "u-1",
    "anonymousId": "a-1",
    "properties": {"total": 12.5, "items": [{"sku": "x", "n": 2}], "ok": True, "none": None},
    "context": {"library": {"name": "analytics-python", "version": "2.4.0"}, "ip": "1.2.3.4"},
    "timestamp": "2024-05-01T12:30:00.000+00:00",
    "messageId": "6f3c0a1e-0b0e-4a51-9b56-0d6d9d6b3f1e",
}
JSON_SEEDS: list[bytes] = [
    orjson.dumps(
        {
            "batch": [
                TRACK,
                {"type": "identify", "userId": "u-1", "traits": {"email": "a@b.c"}},
                {"type": "page", "anonymousId": "a-2", "name": "Home", "writeKey": "wk"},
                {"type": "group", "userId": "u", "groupId": "g", "traits": {}},
                {"type": "alias", "userId": "u", "previousId": "a-1"},
                {"type": "screen", "userId": 42, "name": "Main"},
            ],
            "sentAt": "2024-05-01T12:30:01.000Z",
            "context": {"source": "batch"},
            "integrations": {"All": True},
            "writeKey": "wk",
        }
    ),
    orjson.dumps(TRACK),
    orjson.dumps({"type": "page", "anonymousId": "x", "properties": {"path": "/"}}),
    orjson.dumps(
        {
            "api_key": "k",
            "event_type": "pageview",
            "user": {"anonymous_id": "nd9", "id": "u"},
            "eventn_ctx": {"event_id": "e", "user": {"id": "u"}},
            "url": "https://example.com/",
        }
    ),
    orjson.dumps([{"event_type": "a", "user": {"id": 1}}, {"src": "ios"}]),
    orjson.dumps({"template": {"src": "ios", "api_key": "k"}, "events": [{"event_type": "a"}, {}]}),
]


def _otlp_request() -> ExportLogsServiceRequest:
    def kv(key: str, value: AnyValue) -> KeyValue:
        return KeyValue(key=key, value=value)

    nested = AnyValue(
        kvlist_value=KeyValueList(
            values=[
                kv("list", AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1)]))),
                kv("bytes", AnyValue(bytes_value=b"\x00\x01")),
                kv("d", AnyValue(double_value=1.5)),
            ]
        )
    )
    record = LogRecord(
        time_unix_nano=1_700_000_000_000_000_000,
        observed_time_unix_nano=1_700_000_000_000_000_001,
        severity_number=9,
        severity_text="INFO",
        body=nested,
        attributes=[kv("a", AnyValue(string_value="b")), kv("n", AnyValue(bool_value=True))],
        flags=1,
        trace_id=bytes(range(16)),
        span_id=bytes(range(8)),
        event_name="ev",
    )
    return ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=Resource(attributes=[kv("service.name", AnyValue(string_value="s"))]),
                scope_logs=[
                    ScopeLogs(
                        scope=InstrumentationScope(name="lib", version="1"),
                        log_records=[record, LogRecord(body=AnyValue(string_value="plain"))],
                    )
                ],
                schema_url="https://opentelemetry.io/schemas/1.21.0",
            )
        ]
    )


OTLP_PROTO_SEED = _otlp_request().SerializeToString()
OTLP_JSON_SEED = orjson.dumps(
    {
        "resourceLogs": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "s"}}]
                },
                "scopeLogs": [
                    {
                        "scope": {"name": "lib", "version": "1"},
                        "logRecords": [
                            {
                                "timeUnixNano": "1700000000000000000",
                                "severityNumber": 9,
                                "traceId": "000102030405060708090a0b0c0d0e0f",
                                "spanId": "0001020304050607",
                                "body": {"kvlistValue": {"values": [
                                    {"key": "k", "value": {"arrayValue": {"values": [
                                        {"intValue": "5"}, {"doubleValue": 2.5}]}}}]}},
                                "attributes": [{"key": "a", "value": {"boolValue": True}}],
                            }
                        ],
                    }
                ],
            }
        ]
    }
)  # fmt: skip


def test_the_seeds_are_valid() -> None:
    decoders = ["segment batch", "segment track", "segment page"] + ["jitsu classic"] * 3
    by_name = dict(JSON_DECODERS)
    for seed, name in zip(JSON_SEEDS, decoders, strict=True):
        assert isinstance(check(by_name[name], seed), Intake), name
    assert len(check(OTLP_PROTO, OTLP_PROTO_SEED).events) == 2  # type: ignore[union-attr]
    assert len(check(OTLP_JSON, OTLP_JSON_SEED).events) == 1  # type: ignore[union-attr]


def test_over_100k_inputs_are_thrown() -> None:
    assert sum(PLAN.values()) >= 100_000


# --- byte-level mutation -------------------------------------------------------------------------

TOKENS = [
    b"null", b"true", b"false", b"[", b"]", b"{", b"}", b'"', b",", b":", b"\\", b"1e999",
    b"-1e999", b"NaN", b"Infinity", b"-0", b"1" * 400, b"99999999999999999999999999",
    b"-9223372036854775809", b"1.7976931348623157e309", b'"\\ud800"', b'"\\u0000"', b"\xff",
    b"\xc0\x80", b"\xed\xa0\x80", b"\x00", b'"type"', b'"batch"', b'"userId"', b'"event"',
    b'"writeKey"', b'"context"', b'"template"', b'"events"', b'"resourceLogs"', b'"traceId"',
    b"[" * 300, b'{"a":' * 300, b"[" * 2000, b"\xef\xbb\xbf", b" " * 50,
]  # fmt: skip


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 6))):
        n = len(out)
        op = rng.randrange(9)
        i = rng.randrange(n + 1)
        if op == 0 and n:
            out[min(i, n - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            out[min(i, n - 1)] = rng.randrange(256)
        elif op == 2:
            out[i:i] = rng.choice(TOKENS)
        elif op == 3 and n:
            del out[i : i + rng.randrange(1, 40)]
        elif op == 4:
            del out[i:]
        elif op == 5 and n:
            out[i:i] = out[i : i + rng.randrange(1, 200)]
        elif op == 6:
            other = rng.choice(corpus)
            out = out[:i] + other[rng.randrange(len(other) + 1) :]
        elif op == 7:
            out[i:i] = rng.randbytes(rng.randrange(1, 16))
        else:
            out[i:i] = rng.choice(TOKENS) * rng.randrange(1, 20)
    return bytes(out)


def test_byte_mutations_of_valid_json_bodies() -> None:
    rng = random.Random(1)
    for _ in range(PLAN["byte_mutations"]):
        body = mutate(rng, rng.choice(JSON_SEEDS), JSON_SEEDS)
        for _name, decoder in rng.sample(JSON_DECODERS[:-1], 2):
            check(decoder, body)


# --- structural mutation: valid JSON with wrong types, odd values, deep nesting --------------

WEIRD_RAW = [
    b"null", b"true", b"0", b"-1", b"1.5", b'""', b'"x"', b"[]", b"{}", b"[null]", b'[""]',
    b"18446744073709551615", b"18446744073709551616", b"-9223372036854775808",
    b"1" * 5000, b"1e308", b"-1e308", b"5e-324", b"1e-400", b'"' + b"x" * 70_000 + b'"',
    b'"\\ud83d\\ude00 \xc3\xa9"', b'"\\u0000"', b"[" * 250 + b"]" * 250,
    b'{"a":' * 260 + b"1" + b"}" * 260, b"[" * 1023 + b"]" * 1023, b"[" * 1100 + b"]" * 1100,
    b'{"type":"track"}', b'{"userId":{}}', b"[" + b"{}," * 600 + b"{}]",
]  # fmt: skip
PLACEHOLDER = "\x00weird\x00"


def _replace_somewhere(rng: random.Random, node: Any) -> Any:
    """``node`` with one random descendant replaced by the placeholder (or a key dropped)."""
    if isinstance(node, dict) and node and rng.random() < 0.85:
        key = rng.choice(list(node))
        copy = dict(node)
        roll = rng.random()
        if roll < 0.15:
            del copy[key]
        elif roll < 0.25:
            copy[rng.choice(["type", "batch", "userId", "event", "context", "writeKey", "x"])] = (
                PLACEHOLDER
            )
        else:
            copy[key] = _replace_somewhere(rng, node[key])
        return copy
    if isinstance(node, list) and node and rng.random() < 0.85:
        i = rng.randrange(len(node))
        copy = list(node)
        copy[i] = _replace_somewhere(rng, node[i])
        return copy
    return PLACEHOLDER


def test_structural_mutations_of_valid_json_bodies() -> None:
    rng = random.Random(2)
    docs = [orjson.loads(s) for s in JSON_SEEDS]
    placeholder = orjson.dumps(PLACEHOLDER)
    for _ in range(PLAN["structural_mutations"]):
        doc = _replace_somewhere(rng, rng.choice(docs))
        body = orjson.dumps(doc).replace(placeholder, rng.choice(WEIRD_RAW))
        for _name, decoder in rng.sample(JSON_DECODERS[:-1], 2):
            check(decoder, body)


# --- OTLP ----------------------------------------------------------------------------------------


def _deep_any_value(depth: int) -> bytes:
    """An AnyValue nesting kvlists ``depth`` deep, encoded by hand (no recursion limits)."""

    def field(number: int, payload: bytes) -> bytes:
        length, size = bytearray(), len(payload)
        while size > 0x7F:
            length.append(size & 0x7F | 0x80)
            size >>= 7
        length.append(size)
        return bytes([number << 3 | 2]) + bytes(length) + payload

    value = field(1, b"leaf")  # AnyValue.string_value
    for _ in range(depth):
        key_value = field(1, b"k") + field(2, value)  # KeyValue{key, value}
        value = field(6, field(1, key_value))  # AnyValue.kvlist_value{values}
    record = field(5, value)  # LogRecord.body
    return field(1, field(2, field(2, record)))  # request.resource_logs.scope_logs.log_records


def test_otlp_protobuf_mutations() -> None:
    rng = random.Random(3)
    corpus = [OTLP_PROTO_SEED, _deep_any_value(20)]
    for depth in (50, 95, 99, 100, 101, 150, 5000):
        check(OTLP_PROTO, _deep_any_value(depth))
    for _ in range(PLAN["otlp_protobuf_mutations"]):
        check(OTLP_PROTO, mutate(rng, rng.choice(corpus), corpus))


def test_otlp_json_mutations() -> None:
    rng = random.Random(4)
    doc = orjson.loads(OTLP_JSON_SEED)
    placeholder = orjson.dumps(PLACEHOLDER)
    for i in range(PLAN["otlp_json_mutations"]):
        if i % 2:
            body = mutate(rng, OTLP_JSON_SEED, [OTLP_JSON_SEED])
        else:
            body = orjson.dumps(_replace_somewhere(rng, doc))
            body = body.replace(placeholder, rng.choice(WEIRD_RAW))
        check(OTLP_JSON, body)


# --- random bytes and compressed bodies ---------------------------------------------------------


def test_random_bytes_into_every_decoder() -> None:
    rng = random.Random(5)
    for i in range(PLAN["random_bytes"]):
        body = rng.randbytes(rng.choice((1, 2, 8, 64, 512)))
        if i % 4 == 0:
            body = rng.choice((b"{", b"[", b'{"batch":', b'{"resourceLogs":')) + body
        _name, decoder = ALL_DECODERS[i % len(ALL_DECODERS)]
        check(decoder, body)


def _bomb(inflated: int, members: int = 1) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    one = c.compress(bytes(inflated)) + c.flush()
    return one * members


def _read_then(decoder: Decoder, encoding: str) -> Decoder:
    def run(raw: bytes) -> Intake:
        return decoder(decode_body(raw, encoding, LIMITS.max_body_bytes))

    return run


def test_compressed_bodies_corrupt_truncated_and_bombs() -> None:
    rng = random.Random(6)
    segment = JSON_DECODERS[0][1]
    gz = [gzip.compress(s) for s in JSON_SEEDS]
    zl = [zlib.compress(s) for s in JSON_SEEDS]
    for bomb, encoding in [
        (_bomb(64 << 20), "gzip"),
        (_bomb(300_000, members=40), "gzip"),
        (zlib.compress(bytes(64 << 20), 9), "deflate"),
        (gzip.compress(gzip.compress(bytes(32 << 20))), "gzip, gzip"),
        (gzip.compress(b"[" * (1 << 19)), "gzip"),
        (gzip.compress(b'{"batch":[' + b'{"type":"page","userId":"u"},' * 9_000 + b"{}]}"), "gzip"),
    ]:  # fmt: skip
        outcome = check(_read_then(segment, encoding), bomb)
        assert isinstance(outcome, Rejected)
    for i in range(PLAN["compressed_mutations"]):
        if i % 2:
            raw, encoding = mutate(rng, rng.choice(gz), gz), "gzip"
        else:
            raw, encoding = mutate(rng, rng.choice(zl), zl), "deflate"
        check(_read_then(segment, encoding), raw)


# --- hypothesis ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(
        st.sampled_from(
            ["type", "event", "userId", "anonymousId", "batch", "context", "writeKey", "sentAt",
             "event_type", "api_key", "user", "template", "events", "resourceLogs", "scopeLogs",
             "logRecords", "traceId", "body", "groupId", "previousId"]
        )
        | st.text(max_size=8),
        children,
        max_size=6,
    ),
    max_leaves=30,
)  # fmt: skip

FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(FUZZ, max_examples=PLAN["hypothesis_json"])
@given(doc=json_values, which=st.integers(0, len(JSON_DECODERS) - 1))
def test_hypothesis_arbitrary_json(doc: Any, which: int) -> None:
    check(JSON_DECODERS[which][1], orjson.dumps(doc))


@settings(FUZZ, max_examples=PLAN["hypothesis_bytes"])
@given(body=st.binary(max_size=300), which=st.integers(0, len(ALL_DECODERS) - 1))
def test_hypothesis_arbitrary_bytes(body: bytes, which: int) -> None:
    check(ALL_DECODERS[which][1], body)


ids = st.text(min_size=1, max_size=12) | st.integers(-(2**63), 2**63 - 1)
valid_events = st.fixed_dictionaries(
    {"type": st.just("track"), "event": st.text(min_size=1, max_size=10), "userId": ids},
    optional={"properties": st.dictionaries(st.text(max_size=8), json_values, max_size=4)},
)


@settings(FUZZ, max_examples=PLAN["hypothesis_valid_batches"])
@given(batch=st.lists(valid_events, min_size=1, max_size=20))
def test_hypothesis_valid_batches_come_out_as_sent(batch: list[dict[str, Any]]) -> None:
    intake = check(JSON_DECODERS[0][1], orjson.dumps({"batch": batch}))
    assert isinstance(intake, Intake)
    assert [orjson.loads(e.value) for e in intake.events] == batch
    assert [e.value for e in intake.events] == [orjson.dumps(e) for e in batch]
