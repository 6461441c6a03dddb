"""Malformed input for the Raccoon decoders: whatever comes in, out comes a valid ``Intake`` or
a ``Rejected`` with a reason, never another exception.

Hypothesis explores structured inputs (valid requests mutated, JSON of any shape); a plain loop
of seeded random mutations adds volume cheaply. Together they throw well over 100k inputs.
"""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Code, Rejected
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols import raccoon
from headwater.collector.protocols.raccoon import decode_request, decode_request_json

LIMITS = LimitsConfig(max_batch_events=50)
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
Decoder = Callable[[Any, LimitsConfig], Intake]


def outcome(decode: Decoder, data: bytes | str) -> Intake | Rejected:
    """Decode ``data`` and check the result is well formed, whichever it is."""
    try:
        intake = decode(data, LIMITS)
    except Rejected as e:
        assert isinstance(e.reason, str) and e.reason
        assert (e.status, e.code) == (400, Code.BAD_REQUEST)
        # every refusal can be answered in both encodings
        raccoon.SendEventResponse.FromString(raccoon.error_response_bytes(e))
        json.loads(raccoon.error_response_json(e))
        return e
    assert isinstance(intake, Intake)
    assert 0 < len(intake.events) <= LIMITS.max_batch_events
    for event in intake.events:
        assert type(event) is EventIn
        assert type(event.type) is str and event.type
        event.type.encode()  # valid Unicode text, so it fits a header
        assert type(event.value) is bytes
        assert event.content_type == raccoon.CONTENT_TYPE and event.key is None
    assert intake.request_id is None or (type(intake.request_id) is str and intake.request_id)
    if intake.request_id is not None:
        intake.request_id.encode()
    assert set(intake.meta) <= {"sent_time"}
    return intake


def check_binary(data: bytes) -> Intake | Rejected:
    result = outcome(decode_request, data)
    try:
        raccoon.SendEventRequest.FromString(data)
    except DecodeError:
        # the parser refused it: the reason must say where and why, not just echo the parser
        assert isinstance(result, Rejected)
        assert result.reason.startswith("malformed protobuf: at byte "), result.reason
    else:
        assert not (isinstance(result, Rejected) and result.kind == "malformed")
    return result


def check_json(data: bytes | str) -> Intake | Rejected:
    return outcome(decode_request_json, data)


# --- seeds -------------------------------------------------------------------------------------


def valid_request(guid: str, events: list[tuple[bytes, str]], sent: tuple[int, int] | None) -> Any:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    if sent is not None:
        req.sent_time.seconds, req.sent_time.nanos = sent
    for value, kind in events:
        req.events.add(event_bytes=value, type=kind)
    return req


SEED_REQUESTS = [
    valid_request("g-1", [(b"\x08\x96\x01", "click"), (b"", "view")], (1_700_000_000, 5)),
    valid_request("", [(bytes(range(40)), "t" * 30)] * 5, None),
    valid_request("ü" * 10, [(b"x" * 300, "long")], (0, 0)),
]
SEED_BINARY = [r.SerializeToString() for r in SEED_REQUESTS]
SEED_JSON = [
    json.dumps(
        {
            "req_guid": "g-1",
            "sent_time": "2023-11-14T22:13:20.005Z",
            "events": [{"event_bytes": "CJYB", "type": "click"}, {"type": "view"}],
        }
    ),
    json.dumps(
        {
            "reqGuid": "g-2",
            "sentTime": {"seconds": 1_700_000_000, "nanos": 5},
            "events": [{"eventBytes": base64.urlsafe_b64encode(bytes(range(64))).decode()}] * 3,
        }
    ),
    '{"events":[{"type":"a","event_bytes":"YWJj"}],"req_guid":"\\u00fc\\ud83d\\ude00"}',
]


def test_the_seeds_are_valid() -> None:
    for data in SEED_BINARY:
        assert isinstance(check_binary(data), Intake)
    for text in SEED_JSON[:1] + SEED_JSON[2:]:
        assert isinstance(check_json(text), Intake)
    assert "empty type" in str(check_json(SEED_JSON[1]))


# --- hypothesis: binary ------------------------------------------------------------------------


@settings(FUZZ, max_examples=3000)
@given(st.binary(max_size=400))
def test_random_bytes(data: bytes) -> None:
    check_binary(data)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# Wire-level pieces: tags of known and unknown fields with any wire type, varints of every size
# (up to overlong ones), lengths that lie.
wire_piece = st.one_of(
    st.builds(lambda f, w: varint((f << 3) | w), st.integers(0, 40), st.integers(0, 7)),
    st.builds(varint, st.integers(0, 2**64 - 1)),
    st.binary(min_size=1, max_size=12).map(lambda b: b"\xff" * len(b) + b"\x01"),
    st.integers(1, 11).map(lambda n: b"\x80" * (n - 1) + b"\x00"),  # overlong zeros
    st.builds(lambda n, b: varint(n) + b, st.integers(0, 2**35), st.binary(max_size=16)),
    st.sampled_from([b"\x0b", b"\x0c", b"\x1a\x00", b"\x12\x00", b"\x0a\x00", b"\xc3\x28"]),
    st.binary(max_size=8),
)


@settings(FUZZ, max_examples=3000)
@given(st.lists(wire_piece, max_size=30))
def test_wire_level_garbage(pieces: list[bytes]) -> None:
    check_binary(b"".join(pieces))


requests = st.builds(
    valid_request,
    st.text(max_size=20),
    st.lists(st.tuples(st.binary(max_size=40), st.text(max_size=12)), max_size=12),
    st.none() | st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1)),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(requests).SerializeToString())
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(data):
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0B, 0x0C, 0x0F]))
        elif op == "insert":
            data[at:at] = draw(wire_piece)
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "dup":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


@settings(FUZZ, max_examples=3000)
@given(mutated())
def test_mutated_requests(data: bytes) -> None:
    check_binary(data)


@settings(FUZZ, max_examples=1000)
@given(requests)
def test_valid_requests_decode_to_what_was_sent(req: Any) -> None:
    result = check_binary(req.SerializeToString())
    types = [e.type for e in req.events]
    if not types or len(types) > LIMITS.max_batch_events or "" in types:
        assert isinstance(result, Rejected)
    elif isinstance(result, Intake):
        assert [(e.type, e.value) for e in result.events] == [
            (e.type, e.event_bytes) for e in req.events
        ]
        assert result.request_id == (req.req_guid or None)
    else:
        assert "sent_time" in result.reason


# --- hypothesis: JSON --------------------------------------------------------------------------


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=15,
)
field_values = st.one_of(
    json_values,
    st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()),
    st.binary(max_size=30).map(lambda b: base64.urlsafe_b64encode(b).decode().rstrip("=")),
    st.text(alphabet="ABCab+/-_=\\ \n", max_size=12),
    st.sampled_from(["2024-05-01T12:30:00Z", "2024-13-01T00:00:00Z", "9999-12-31T23:59:59-01:00"]),
    st.fixed_dictionaries({}, optional={"seconds": json_values, "nanos": json_values}),
)
events_json = st.lists(
    st.dictionaries(st.sampled_from(["type", "event_bytes", "eventBytes", "x"]), field_values)
    | json_values,
    max_size=12,
)
requests_json = st.dictionaries(
    st.sampled_from(["req_guid", "reqGuid", "sent_time", "sentTime", "events", "other"]),
    field_values | events_json,
)


@settings(FUZZ, max_examples=1500)
@given(requests_json)
def test_request_shaped_json(doc: dict[str, Any]) -> None:
    check_json(json.dumps(doc))


@settings(FUZZ, max_examples=1000)
@given(json_values)
def test_any_json(doc: Any) -> None:
    check_json(json.dumps(doc))


@settings(FUZZ, max_examples=2000)
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_any_text(data: str | bytes) -> None:
    check_json(data)


@settings(FUZZ, max_examples=2000)
@given(st.sampled_from(SEED_JSON), st.lists(st.tuples(st.integers(0, 400), st.text(max_size=3))))
def test_mutated_json(seed: str, edits: list[tuple[int, str]]) -> None:
    text = seed
    for at, insert in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + 1 :]
    check_json(text)
    check_json(text.encode("utf-8", "surrogatepass"))


# --- fixed nasties -----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [10, 1000, 10_000, 200_000])
def test_deeply_nested_json(depth: int) -> None:
    for text in [
        "[" * depth + "]" * depth,
        '{"a":' * depth + "1" + "}" * depth,
        '{"events": [' + "[" * depth + "]" * depth + "]}",
        '{"events": [{"type": "a", "event_bytes": ' + "[" * depth + "]" * depth + "}]}",
        '{"sent_time": {"seconds": ' + '{"a":' * depth + "1" + "}" * depth + "}}",
        "[" * depth,
    ]:
        assert isinstance(check_json(text), Rejected)


@pytest.mark.parametrize("depth", [50, 99, 100, 101, 1000, 100_000])
def test_deeply_nested_groups(depth: int) -> None:
    check_binary(b"\x0b" * depth + b"\x0c" * depth + SEED_BINARY[0])
    check_binary(b"\x0b" * depth)
    check_binary(b"\x1a" + varint(2 * depth) + b"\x0b" * depth + b"\x0c" * depth)


def test_huge_numbers() -> None:
    for data in [
        b"\x08" + b"\xff" * 10_000,
        b"\x0a" + b"\xff" * 9 + b"\x01",
        b"\x0a" + b"\x80" * 9 + b"\x00",  # an overlong zero length
        b"\x12\x0b\x08" + b"\xff" * 9 + b"\x01" + b"\x1a\x03\x12\x01a",
        b"\x1a" + varint(2**31) + b"x",
        b"\x1a" + varint(2**64 - 1),
    ]:
        check_binary(data)
    for text in [
        '{"sent_time": {"seconds": ' + "9" * 4000 + '}, "events": [{"type": "a"}]}',
        '{"sent_time": {"seconds": ' + "9" * 5000 + '}, "events": [{"type": "a"}]}',
        '{"sent_time": {"seconds": 1e999}, "events": [{"type": "a"}]}',
        '{"sent_time": {"nanos": -1e-999}, "events": [{"type": "a"}]}',
        '{"events": [{"type": "a"}], "req_guid": NaN}',
        '{"events": [{"type": "a"}], "req_guid": "' + "x" * 100_000 + '"}',
    ]:
        check_json(text)


def test_too_many_events_is_refused_before_they_are_read() -> None:
    many = b"\x1a\x00" * 100_000
    assert "the batch has 100000 events" in str(check_binary(many))
    text = '{"events": [' + ",".join(["1"] * 100_000) + "]}"
    assert "the batch has 100000 events" in str(check_json(text))


# --- a fast loop of plain random mutations -----------------------------------------------------

JSON_TOKENS = [*'{}[]",:\\', "null", "true", "1e400", "-0", '"\\ud800"', '"\\u0000"', "\x00", "é"]


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(out))
        op = rng.randrange(6)
        if op == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and at < len(out):
            out[at] = rng.randrange(256)
        elif op == 2:
            out[at:at] = rng.randbytes(rng.randint(1, 6))
        elif op == 3:
            del out[at : at + rng.randint(1, 8)]
        elif op == 4:
            del out[at:]
        else:
            out[at:at] = varint(rng.getrandbits(rng.choice([7, 32, 64, 70])))
    return bytes(out)


def mutate_text(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(text))
        op = rng.randrange(4)
        if op == 0:
            text = text[:at] + rng.choice(JSON_TOKENS) + text[at:]
        elif op == 1:
            text = text[:at] + text[at + rng.randint(1, 6) :]
        elif op == 2:
            text = text[:at]
        else:
            text = text[:at] + rng.choice(string.printable) + text[at + 1 :]
    return text


ROUNDS = 100_000


def test_plain_random_mutations() -> None:
    """ROUNDS binary and ROUNDS JSON inputs, on top of the hypothesis examples."""
    rng = random.Random(20240501)
    outcomes = {"binary": [0, 0], "json": [0, 0]}
    for i in range(ROUNDS):
        if i % 8 == 0:
            data = rng.randbytes(rng.randint(0, 64))
        else:
            data = mutate_bytes(rng, SEED_BINARY[i % len(SEED_BINARY)])
        try:
            accepted = isinstance(check_binary(data), Intake)
        except AssertionError:
            raise AssertionError(f"binary input {data!r}") from None
        outcomes["binary"][accepted] += 1

        text = mutate_text(rng, SEED_JSON[i % len(SEED_JSON)])
        try:
            accepted = isinstance(check_json(text), Intake)
        except AssertionError:
            raise AssertionError(f"JSON input {text!r}") from None
        outcomes["json"][accepted] += 1
    # both outcomes occur, so the mutations neither always break nor never touch the input
    for refused, accepted in outcomes.values():
        assert refused > ROUNDS // 10 and accepted > ROUNDS // 100, outcomes
