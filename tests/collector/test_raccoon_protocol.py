"""The Raccoon wire protocol: descriptor, golden bytes, decoding both encodings, every class of
bad input with its reason, and the responses."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, json_format

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Code, Rejected, bad_request, unavailable
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols import raccoon
from headwater.collector.protocols.raccoon import (
    RequestRejected,
    Status,
    decode_request,
    decode_request_json,
)

LIMITS = LimitsConfig()
PB = "application/x-protobuf"
F = descriptor_pb2.FieldDescriptorProto

# SendEventRequest{req_guid: "guid-1", sent_time: {1700000000 s, 5000000 ns},
#                  events: [{event_bytes: 08 96 01, type: "click"}, {type: "view"}]}
GOLDEN_REQUEST = bytes.fromhex(
    "0a06" + b"guid-1".hex()  # 1: req_guid
    + "120b" + "0880e2cfaa06" + "10c096b102"  # 2: sent_time {1: seconds, 2: nanos}
    + "1a0c" + "0a03089601" + "1205" + b"click".hex()  # 3: events[0]
    + "1a06" + "1204" + b"view".hex()  # 3: events[1], empty event_bytes left out
)  # fmt: skip
# ok_response("guid-1") sent at 1700000000123 ms (written in seconds)
GOLDEN_OK = bytes.fromhex(
    "0801" + "1001" + "1880e2cfaa06"  # status SUCCESS, code OK, sent_time
    + "2a12" + "0a08" + b"req_guid".hex() + "1206" + b"guid-1".hex()  # data entry
)  # fmt: skip
# error_response(bad_request("no"), "g") sent at the same time
GOLDEN_ERROR = bytes.fromhex(
    "0802" + "1002" + "1880e2cfaa06" + "2202" + b"no".hex()
    + "2a0d" + "0a08" + b"req_guid".hex() + "1201" + b"g".hex()
)  # fmt: skip
SENT_MS = 1_700_000_000_123


def golden_intake() -> Intake:
    return Intake(
        [EventIn("click", b"\x08\x96\x01", PB), EventIn("view", b"", PB)],
        "guid-1",
        {"sent_time": "2023-11-14T22:13:20.005Z"},
    )


def make_request(guid: str = "g", n: int = 3, seconds: int | None = None, nanos: int = 0) -> Any:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    if seconds is not None:
        req.sent_time.seconds = seconds
        req.sent_time.nanos = nanos
    for i in range(n):
        req.events.add(event_bytes=b"\x0a\x02hi" + bytes([i]), type=f"t{i}")
    return req


def refused(fn: Any, data: Any, limits: LimitsConfig = LIMITS) -> Rejected:
    with pytest.raises(Rejected) as info:
        fn(data, limits)
    err = info.value
    assert (err.status, err.code) == (400, Code.BAD_REQUEST)
    return err


# --- the descriptor ----------------------------------------------------------------------------


def test_descriptor_matches_the_raccoon_proto() -> None:
    # what the pool holds, read back as a FileDescriptorProto
    registered = descriptor_pb2.FileDescriptorProto()
    raccoon.SendEventRequest.DESCRIPTOR.file.CopyToProto(registered)
    assert registered.package == "raystack.raccoon.v1beta1"
    messages = {m.name: m for m in registered.message_type}

    def fields(name: str) -> dict[str, tuple[int, int, bool, str]]:
        return {
            f.name: (f.number, f.type, f.label == F.LABEL_REPEATED, f.type_name.lstrip("."))
            for f in messages[name].field
        }

    opt, rep = False, True
    assert fields("SendEventRequest") == {
        "req_guid": (1, F.TYPE_STRING, opt, ""),
        "sent_time": (2, F.TYPE_MESSAGE, opt, "google.protobuf.Timestamp"),
        "events": (3, F.TYPE_MESSAGE, rep, "raystack.raccoon.v1beta1.Event"),
    }
    assert fields("Event") == {
        "event_bytes": (1, F.TYPE_BYTES, opt, ""),
        "type": (2, F.TYPE_STRING, opt, ""),
    }
    resp_fields = fields("SendEventResponse")
    assert resp_fields.pop("data")[:3] == (5, F.TYPE_MESSAGE, rep)
    assert resp_fields == {
        "status": (1, F.TYPE_ENUM, opt, "raystack.raccoon.v1beta1.Status"),
        "code": (2, F.TYPE_ENUM, opt, "raystack.raccoon.v1beta1.Code"),
        "sent_time": (3, F.TYPE_INT64, opt, ""),
        "reason": (4, F.TYPE_STRING, opt, ""),
    }
    data = raccoon.SendEventResponse.DESCRIPTOR.fields_by_name["data"].message_type
    assert data.GetOptions().map_entry
    assert [(f.name, f.number, f.type) for f in data.fields] == [
        ("key", 1, F.TYPE_STRING),
        ("value", 2, F.TYPE_STRING),
    ]
    enums = raccoon.SendEventResponse.DESCRIPTOR.fields_by_name
    assert {v.name: v.number for v in enums["status"].enum_type.values} == {
        "STATUS_UNSPECIFIED": 0,
        "STATUS_SUCCESS": 1,
        "STATUS_ERROR": 2,
    }
    assert {v.name: v.number for v in enums["code"].enum_type.values} == {
        "CODE_UNSPECIFIED": 0,
        "CODE_OK": 1,
        "CODE_BAD_REQUEST": 2,
        "CODE_INTERNAL_ERROR": 3,
        "CODE_MAX_CONNECTION_LIMIT_REACHED": 4,
        "CODE_MAX_USER_LIMIT_REACHED": 5,
    }
    assert registered == raccoon.file_descriptor()
    [service] = registered.service
    assert f"raystack.raccoon.v1beta1.{service.name}" == raccoon.SERVICE_NAME
    [method] = service.method
    assert (method.name, method.input_type, method.output_type) == (
        "SendEvent",
        ".raystack.raccoon.v1beta1.SendEventRequest",
        ".raystack.raccoon.v1beta1.SendEventResponse",
    )
    assert raccoon.METHOD == "/raystack.raccoon.v1beta1.EventService/SendEvent"


# --- golden bytes ------------------------------------------------------------------------------


def test_golden_request_bytes() -> None:
    req: Any = raccoon.SendEventRequest(req_guid="guid-1")
    req.sent_time.seconds, req.sent_time.nanos = 1_700_000_000, 5_000_000
    req.events.add(event_bytes=b"\x08\x96\x01", type="click")
    req.events.add(type="view")
    assert req.SerializeToString() == GOLDEN_REQUEST
    assert decode_request(GOLDEN_REQUEST, LIMITS) == golden_intake()


def test_golden_response_bytes() -> None:
    assert raccoon.ok_response_bytes("guid-1", SENT_MS) == GOLDEN_OK
    assert raccoon.ok_response("guid-1", SENT_MS).SerializeToString() == GOLDEN_OK
    assert raccoon.error_response_bytes(bad_request("no"), "g", SENT_MS) == GOLDEN_ERROR
    ok = raccoon.encode_response(Status.SUCCESS, Code.OK, "", {"req_guid": "guid-1"}, SENT_MS)
    assert ok == GOLDEN_OK


# --- binary requests ---------------------------------------------------------------------------


def test_binary_round_trip() -> None:
    req = make_request("abc", n=5, seconds=1_714_566_600, nanos=250_000_000)
    intake = decode_request(req.SerializeToString(), LIMITS)
    assert intake.request_id == "abc"
    assert intake.meta == {"sent_time": "2024-05-01T12:30:00.250Z"}
    assert intake.events == [EventIn(f"t{i}", b"\x0a\x02hi" + bytes([i]), PB) for i in range(5)]
    assert all(type(e) is EventIn and e.key is None for e in intake.events)


def test_binary_optional_parts() -> None:
    intake = decode_request(make_request("", n=1).SerializeToString(), LIMITS)
    assert intake.request_id is None
    assert intake.meta == {}
    # a timestamp at the epoch is still a timestamp that was sent
    zero = decode_request(make_request("z", n=1, seconds=0).SerializeToString(), LIMITS)
    assert zero.meta == {"sent_time": "1970-01-01T00:00:00Z"}


def test_binary_fraction_digits_follow_the_json_mapping() -> None:
    for nanos, text in [(1_000_000, ".001"), (1_000, ".000001"), (1, ".000000001")]:
        data = make_request(n=1, seconds=0, nanos=nanos).SerializeToString()
        assert decode_request(data, LIMITS).meta["sent_time"] == f"1970-01-01T00:00:00{text}Z"
    first = make_request(n=1, seconds=-62_135_596_800).SerializeToString()
    assert decode_request(first, LIMITS).meta["sent_time"] == "0001-01-01T00:00:00Z"


def test_unknown_fields_are_ignored() -> None:
    data = make_request("u", n=2).SerializeToString()
    extra = b"\x20\x07" + b"\x2a\x03abc"  # fields 4 (varint) and 5 (bytes), unknown
    event_extra = b"\x1a\x08\x12\x01x\x18\x01\x22\x01y"  # an event with fields 3 and 4
    intake = decode_request(data + extra + event_extra, LIMITS)
    assert [e.type for e in intake.events] == ["t0", "t1", "x"]
    assert intake.request_id == "u"


def test_binary_accepts_memoryview_and_bytearray() -> None:
    data = make_request(n=2).SerializeToString()
    assert decode_request(memoryview(data), LIMITS) == decode_request(data, LIMITS)  # type: ignore[arg-type]
    assert decode_request(bytearray(data), LIMITS) == decode_request(data, LIMITS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "the request has no events"),
        (b"\x0a\x01g", "the request has no events"),
        (b"\x0a\x05ab", "malformed protobuf: at byte 0 (req_guid): the field declares 5 bytes "
         "but its data ends 2 bytes later"),
        (b"\x0a\x02\xff\xfe", "malformed protobuf: at byte 0 (req_guid): the text is not valid "
         "UTF-8"),
        (b"\x1a\x00\x1a\x04\x12\x02\xc3\x28", "malformed protobuf: at byte 4 (events[1].type): "
         "the text is not valid UTF-8"),
        (b"\x0a\x03abc\x1a\x03\x12\x05x", "malformed protobuf: at byte 7 (events[0].type): "
         "the field declares 5 bytes but its data ends 1 bytes later"),
        (b"\x12\x01\x08", "malformed protobuf: at byte 3: the sent_time.seconds varint is cut "
         "off by the end of its data"),
        (b"\x08" + b"\xff" * 11, "malformed protobuf: at byte 1: the field 1 varint is longer "
         "than 10 bytes"),
        (b"\x10" + b"\xff" * 11, "at byte 1: the field 2 varint is longer than 10 bytes"),
        (b"\x1a\x01\x08", "at byte 3: the events[0].field 1 varint is cut off"),
        (b"\x0f", "malformed protobuf: at byte 0 (field 1): wire type 7 does not exist"),
        (b"\x1e", "at byte 0 (field 3): wire type 6 does not exist"),
        (b"\x00\x01", "malformed protobuf: at byte 0: field number 0 is not allowed"),
        (b"\x0c", "at byte 0: an end-group tag (field 1) with no open group"),
        (b"\x23\x2c", "at byte 1: an end-group tag for field 5 closes a group of field 4"),
        (b"\x23", "at byte 1: the group of field 4 is never closed"),
        (b"\x0b" * 150, "nested more than 100 levels deep"),
        (b"\x0a\xff\xff\xff\xff\x0f", "the field declares 4294967295 bytes"),
        (b"\x80\x80\x80\x80\x10", "at byte 0: field tag 4294967296 is larger than 32 bits"),
        (b"\x88\x80\x80\x80\x80\x00", "at byte 0: the field tag varint is longer than 5 bytes"),
        (b"\x0a" + b"\x80" * 5 + b"\x00", "at byte 1: the req_guid length varint is longer than "
         "5 bytes"),
        (b"\x0d\x01\x02", "at byte 0 (field 1): a 4-byte value is cut off"),
        (b"\x09\x01", "at byte 0 (field 1): an 8-byte value is cut off"),
        (b"\x1a\x00", "events[0] has an empty type"),
        (b"\x1a\x03\x12\x01a\x1a\x02\x10\x01", "events[1] has an empty type"),  # type as varint
        (b"\x12\x08\x08\x01\x10\x80\x94\xeb\xdc\x03\x1a\x03\x12\x01a",
         "sent_time is not a valid timestamp: nanos 1000000000 is outside 0..999999999"),
        (b"\x12\x08\x08\xff\xff\xff\xff\xff\xff\x01\x1a\x03\x12\x01a",
         "sent_time is not a valid timestamp: seconds 8796093022207 is outside"),
        (b"\x12\x0b\x08" + b"\x80" * 9 + b"\x01\x1a\x03\x12\x01a",
         "sent_time is not a valid timestamp: seconds -9223372036854775808 is outside"),
    ],
)  # fmt: skip
def test_bad_binary_requests(data: bytes, reason: str) -> None:
    assert reason in refused(decode_request, data).reason


def test_the_end_group_for_a_matching_group_is_fine() -> None:
    # An unknown group (field 4) that opens and closes properly is just an unknown field.
    data = b"\x23\x08\x01\x24" + make_request(n=1).SerializeToString()
    assert len(decode_request(data, LIMITS).events) == 1


def test_refusals_after_the_guid_is_read_carry_it() -> None:
    err = refused(decode_request, b"\x0a\x03abc\x1a\x00")
    assert isinstance(err, RequestRejected) and err.req_guid == "abc"
    assert err.kind == "bad_type"
    # even in bytes the parser cannot read, when the guid comes first
    err = refused(decode_request, b"\x0a\x03abc\x1a\x05\x12")
    assert isinstance(err, RequestRejected) and err.req_guid == "abc"
    assert err.kind == "malformed"
    response: Any = raccoon.error_response(err)
    assert response.data["req_guid"] == "abc"


def test_batch_limit() -> None:
    limits = LimitsConfig(max_batch_events=10)
    assert len(decode_request(make_request(n=10).SerializeToString(), limits).events) == 10
    err = refused(decode_request, make_request(n=12).SerializeToString(), limits)
    assert err.reason == (
        "the batch has 12 events; the limit is 10 (collector.limits.max_batch_events)"
    )
    assert err.kind == "too_many_events"
    data = json.dumps({"events": [{"type": "a"}] * 11})
    assert "the batch has 11 events" in refused(decode_request_json, data, limits).reason


# --- JSON requests -----------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_json_in_both_spellings() -> None:
    snake = {
        "req_guid": "guid-1",
        "sent_time": "2023-11-14T22:13:20.005Z",
        "events": [{"event_bytes": "CJYB", "type": "click"}, {"type": "view"}],
    }
    camel = {
        "reqGuid": "guid-1",
        "sentTime": "2023-11-14T22:13:20.005Z",
        "events": [{"eventBytes": "CJYB", "type": "click"}, {"type": "view", "eventBytes": ""}],
    }
    assert decode_request_json(json.dumps(snake), LIMITS) == golden_intake()
    assert decode_request_json(json.dumps(camel).encode(), LIMITS) == golden_intake()


def test_json_sent_time_as_seconds_and_nanos() -> None:
    """Raccoon's documentation and Go client send the Timestamp's struct form."""
    doc = {
        "req_guid": "guid-1",
        "sent_time": {"seconds": 1_700_000_000, "nanos": 5_000_000},
        "events": [{"eventBytes": "CJYB", "type": "click"}, {"type": "view"}],
    }
    assert decode_request_json(json.dumps(doc), LIMITS) == golden_intake()
    doc["sent_time"] = {"seconds": 1_700_000_000}
    assert decode_request_json(json.dumps(doc), LIMITS).meta == {
        "sent_time": "2023-11-14T22:13:20Z"
    }


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("2024-05-01T12:30:00Z", "2024-05-01T12:30:00Z"),
        ("2024-05-01t12:30:00.5z", "2024-05-01T12:30:00.500Z"),
        ("2024-05-01T12:30:00.123456789Z", "2024-05-01T12:30:00.123456789Z"),
        ("2024-05-01T14:30:00+02:00", "2024-05-01T12:30:00Z"),
        ("2024-05-01T00:30:00-05:30", "2024-05-01T06:00:00Z"),
        ("2024-02-29T00:00:00Z", "2024-02-29T00:00:00Z"),
    ],
)
def test_json_rfc3339_sent_time(text: str, normalized: str) -> None:
    doc = {"sent_time": text, "events": [{"type": "a"}]}
    assert decode_request_json(json.dumps(doc), LIMITS).meta == {"sent_time": normalized}


def test_json_nulls_are_defaults_and_base64_comes_in_every_form() -> None:
    data = bytes(range(250, 256)) + b"\xfb\xff"  # encodes with + and / (- and _ URL-safe)
    std = b64(data)
    assert "+" in std or "/" in std
    url = base64.urlsafe_b64encode(data).decode()
    events = [
        {"event_bytes": std, "type": "a"},
        {"event_bytes": url, "type": "a"},
        {"event_bytes": url.rstrip("="), "type": "a"},
        {"event_bytes": b64(b"ab").rstrip("="), "type": "a"},
        {"event_bytes": None, "type": "b"},
    ]
    doc = {"req_guid": None, "sent_time": None, "events": events}
    intake = decode_request_json(json.dumps(doc), LIMITS)
    assert [e.value for e in intake.events] == [data, data, data, b"ab", b""]
    assert intake.request_id is None and intake.meta == {}


def test_json_matches_protobufs_own_json_parser() -> None:
    """For valid input the reader gives what json_format.Parse gives."""
    docs = [
        {"req_guid": "x", "events": [{"event_bytes": b64(b"\x00\x01\xff"), "type": "t"}]},
        {"reqGuid": "ü-ß", "sentTime": "2021-11-29T03:02:07.376499Z",
         "events": [{"eventBytes": b64(b"abc"), "type": "ü"}, {"type": "v"}]},
        {"events": [{"type": "x", "event_bytes": b64(bytes(range(256)))}]},
        {"sent_time": "1999-12-31T23:59:59.999999999+01:00", "events": [{"type": "x"}]},
    ]  # fmt: skip
    for doc in docs:
        text = json.dumps(doc)
        parsed: Any = json_format.Parse(text, raccoon.SendEventRequest())
        ours = decode_request_json(text, LIMITS)
        assert ours.request_id == (parsed.req_guid or None)
        assert [(e.type, e.value) for e in ours.events] == [
            (e.type, e.event_bytes) for e in parsed.events
        ]
        if parsed.HasField("sent_time"):
            assert ours.meta["sent_time"] == parsed.sent_time.ToJsonString()


def test_the_json_mapping_written_by_protobuf_is_read() -> None:
    req = make_request("j", n=4, seconds=1_700_000_000, nanos=1)
    for names in (True, False):
        text = json_format.MessageToJson(req, preserving_proto_field_name=names)
        assert decode_request_json(text, LIMITS) == decode_request(req.SerializeToString(), LIMITS)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ("", "invalid JSON: Expecting value at line 1 column 1"),
        ("{", "invalid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ('{"events": [}', "invalid JSON: Expecting value at line 1 column 13"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
        (b"\xff\xfe{", "invalid JSON: the text is not valid utf-16"),
        (b'{"req_guid": "\xff"}',
         "invalid JSON: the text is not valid utf-8 (invalid start byte at byte 14)"),
        ('{"x": ' + "1" * 5000 + "}", "invalid JSON: Exceeds the limit"),
        ("[]", "the request must be a JSON object, not an array"),
        ("null", "the request must be a JSON object, not null"),
        ('"x"', "the request must be a JSON object, not a string"),
        ("{}", "the request has no events"),
        ('{"events": []}', "the request has no events"),
        ('{"events": null}', "the request has no events"),
        ('{"events": {}}', "events must be an array, not an object"),
        ('{"req_guid": 1, "events": [{"type": "a"}]}', "req_guid must be a string, not a number"),
        ('{"req_guid": "a", "reqGuid": "b", "events": []}', "req_guid is given twice"),
        ('{"sent_time": "2024-05-01T00:00:00Z", "sentTime": null}', "sent_time is given twice"),
        ('{"events": [], "extra": 1}', "unknown field 'extra' in the request (expected req_guid, "
         "sent_time, events)"),
        ('{"events": [1]}', "events[0] must be an object, not a number"),
        ('{"events": [{"type": "a"}, []]}', "events[1] must be an object, not an array"),
        ('{"events": [{"type": ""}]}', "events[0] has an empty type"),
        ('{"events": [{"event_bytes": "YQ=="}]}', "events[0] has an empty type"),
        ('{"events": [{"type": null}]}', "events[0] has an empty type"),
        ('{"events": [{"type": true}]}', "events[0].type must be a string, not a boolean"),
        ('{"events": [{"type": "a", "event_byte": "YQ=="}]}',
         "unknown field 'event_byte' in events[0] (expected event_bytes, type)"),
        ('{"events": [{"type": "a", "event_bytes": "", "eventBytes": ""}]}',
         "events[0].event_bytes is given twice"),
        ('{"events": [{"type": "a", "event_bytes": 5}]}',
         "events[0].event_bytes must be a base64 string, not a number"),
        ('{"events": [{"type": "a", "event_bytes": "!!!!"}]}',
         "events[0].event_bytes is not valid base64: Only base64 data is allowed"),
        ('{"events": [{"type": "a", "event_bytes": "Y"}]}',
         "events[0].event_bytes is not valid base64: Invalid base64-encoded string"),
        ('{"events": [{"type": "a", "event_bytes": "YQ==YQ=="}]}',
         "events[0].event_bytes is not valid base64: Excess data after padding"),
        ('{"events": [{"type": "a", "event_bytes": "YQ = ="}]}',
         "events[0].event_bytes is not valid base64"),
        ('{"events": [{"type": "a", "event_bytes": "Y\\u00e9Q="}]}',
         "events[0].event_bytes is not valid base64: it holds characters that are not ASCII"),
        ('{"events": [{"type": "\\ud800"}]}', "events[0].type holds a lone surrogate"),
        ('{"req_guid": "\\udfff", "events": [{"type": "a"}]}', "req_guid holds a lone surrogate"),
        ('{"sent_time": 5, "events": [{"type": "a"}]}',
         "sent_time must be an RFC 3339 string or {seconds, nanos}, not a number"),
        ('{"sent_time": "yesterday", "events": [{"type": "a"}]}',
         "sent_time 'yesterday' is not an RFC 3339 timestamp"),
        ('{"sent_time": "2024-05-01 00:00:00Z", "events": [{"type": "a"}]}',
         "is not an RFC 3339 timestamp"),
        ('{"sent_time": "2024-05-01T00:00:00", "events": [{"type": "a"}]}',
         "is not an RFC 3339 timestamp"),
        ('{"sent_time": "2024-02-30T00:00:00Z", "events": [{"type": "a"}]}',
         "is not a valid time (day is out of range for month)"),
        ('{"sent_time": "2024-05-01T24:00:00Z", "events": [{"type": "a"}]}',
         "is not a valid time (hour must be in 0..23)"),
        ('{"sent_time": "0000-05-01T00:00:00Z", "events": [{"type": "a"}]}',
         "is not a valid time (year 0 is out of range)"),
        ('{"sent_time": "2024-05-01T00:00:00.1234567891Z", "events": [{"type": "a"}]}',
         "is not an RFC 3339 timestamp"),
        ('{"sent_time": "2024-05-01T00:00:00+25:00", "events": [{"type": "a"}]}',
         "the offset +25:00 is not valid"),
        ('{"sent_time": "0001-01-01T00:00:00+01:00", "events": [{"type": "a"}]}',
         "seconds -62135600400 is outside 0001-01-01..9999-12-31"),
        ('{"sent_time": {"seconds": "1"}, "events": [{"type": "a"}]}',
         "sent_time.seconds must be an integer, not a string"),
        ('{"sent_time": {"seconds": 1.5}, "events": [{"type": "a"}]}',
         "sent_time.seconds must be an integer, not a number"),
        ('{"sent_time": {"nanos": true}, "events": [{"type": "a"}]}',
         "sent_time.nanos must be an integer, not a boolean"),
        ('{"sent_time": {"nanos": -1}, "events": [{"type": "a"}]}',
         "sent_time is not a valid timestamp: nanos -1 is outside 0..999999999"),
        ('{"sent_time": {"seconds": 1e400}, "events": [{"type": "a"}]}',
         "sent_time.seconds must be an integer, not a number"),
        ('{"sent_time": {"second": 1}, "events": [{"type": "a"}]}',
         "unknown field 'second' in sent_time (expected seconds, nanos)"),
    ],
)  # fmt: skip
def test_bad_json_requests(data: str | bytes, reason: str) -> None:
    assert reason in refused(decode_request_json, data).reason


def test_json_refusals_carry_the_guid() -> None:
    err = refused(decode_request_json, '{"req_guid": "r-7", "events": [{"type": ""}]}')
    assert isinstance(err, RequestRejected) and err.req_guid == "r-7"
    err = refused(decode_request_json, '{"reqGuid": "r-8", "bogus": 1}')
    assert isinstance(err, RequestRejected) and err.req_guid == "r-8"


# --- responses ---------------------------------------------------------------------------------


def test_ok_response_json_is_what_raccoon_writes() -> None:
    text = raccoon.ok_response_json("guid-1", SENT_MS)
    assert text == '{"status":1,"code":1,"sent_time":1700000000,"data":{"req_guid":"guid-1"}}'
    # and clients that use protobuf's JSON parser read it
    parsed: Any = json_format.Parse(text, raccoon.SendEventResponse())
    assert parsed.SerializeToString(deterministic=True) == GOLDEN_OK
    assert raccoon.response_json(raccoon.ok_response("guid-1", SENT_MS)) == text


def test_error_responses() -> None:
    text = raccoon.error_response_json(bad_request("the request has no events"), "g", SENT_MS)
    assert json.loads(text) == {
        "status": 2,
        "code": 2,
        "sent_time": 1_700_000_000,
        "reason": "the request has no events",
        "data": {"req_guid": "g"},
    }
    busy: Any = raccoon.error_response(unavailable("the log is full", retry_after=2), "b")
    assert (busy.status, busy.code, busy.reason) == (2, Code.INTERNAL_ERROR, "the log is full")
    assert dict(busy.data) == {"req_guid": "b", "retry_after": "2"}
    # without a guid, data still names req_guid
    anonymous: Any = raccoon.error_response(bad_request("bad"))
    assert dict(anonymous.data) == {"req_guid": ""}
    assert json.loads(raccoon.error_response_json(bad_request("bad")))["data"] == {"req_guid": ""}
    # an explicit guid wins over the one a refusal carries
    carried = RequestRejected("bad", "inner", "bad_request")
    assert raccoon.error_response(carried).data["req_guid"] == "inner"  # type: ignore[attr-defined]
    assert raccoon.error_response(carried, "outer").data["req_guid"] == "outer"  # type: ignore[attr-defined]


def test_response_sent_time_defaults_to_now_in_seconds() -> None:
    import time

    before = int(time.time())
    response: Any = raccoon.SendEventResponse.FromString(raccoon.ok_response_bytes("x"))
    assert before <= response.sent_time <= int(time.time())
    assert before <= json.loads(raccoon.ok_response_json("x"))["sent_time"] <= int(time.time())


def test_response_json_escapes_what_it_must() -> None:
    reason = 'type "a\nb" \ud800'
    text = raccoon.encode_response_json(Status.ERROR, Code.BAD_REQUEST, reason, {"req_guid": ""})
    assert text.isascii()
    assert json.loads(text)["reason"] == reason
