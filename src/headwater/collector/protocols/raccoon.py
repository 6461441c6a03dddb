"""The Raccoon wire protocol (``raystack.raccoon.v1beta1``): requests in, responses out.

The messages are built at import time from a ``FileDescriptorProto`` written out below and kept
in a private descriptor pool, so no generated code is needed and nothing else that registers
Raccoon's protos can clash with it.

Decoding (the hot path, one call per request):

- ``decode_request`` takes binary protobuf. Unknown fields are ignored, as every proto3 parser
  (and Raccoon itself) does, so a newer client's extra fields do no harm; a known field sent
  with the wrong wire type is likewise an unknown field, which leaves that field empty, and an
  empty ``type`` is refused. Anything the parser cannot read is refused with the first problem
  found in the bytes and where it is ("malformed protobuf: at byte 7 (events[0].type): ...").
- ``decode_request_json`` takes protobuf's JSON mapping: both ``req_guid`` and ``reqGuid``
  (``sent_time``/``sentTime``, ``event_bytes``/``eventBytes``), ``null`` for a default value,
  ``sent_time`` as an RFC 3339 string or as ``{"seconds": ..., "nanos": ...}`` (the form
  Raccoon's documentation and its Go client send), bytes in standard or URL-safe base64 with or
  without padding. It is a hand-written reader, not ``json_format.Parse``: that one costs about
  9 us per event against about 1 us here, and it lets invalid base64 through (it drops characters
  outside the alphabet). Unknown fields are refused, as the JSON mapping's default says, so a
  misspelt ``event_bytes`` cannot silently store an empty event.

Every refusal is a ``Rejected`` (``CODE_BAD_REQUEST``) naming what was wrong; once the request's
``req_guid`` is known the refusal is a ``RequestRejected`` that carries it, so the error
response can name the request it answers. An event's ``event_bytes`` may be empty (that is how
a proto message whose fields all hold defaults serializes).

Responses: ``SendEventResponse`` in binary, or in JSON as Raccoon's own server writes it:
``{"status":1,"code":1,"sent_time":1638155915,"data":{"req_guid":"..."}}``: field names as in
the proto, enums and ``sent_time`` as numbers (Raccoon's Go client reads them into integers; a
JSON-mapping parser accepts numbers too), ``reason`` left out when empty. ``sent_time`` is in
seconds, as Raccoon sends it. ``data`` always holds ``req_guid``.
"""

from __future__ import annotations

import binascii
import json
import re
import time
from datetime import UTC, datetime, timedelta
from enum import IntEnum
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
from google.protobuf.message import DecodeError, Message

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Code, Rejected, bad_request
from headwater.collector.events import EventIn, Intake, event_type
from headwater.collector.protocols.body import json_kind, with_article

__all__ = [
    "CONTENT_TYPE",
    "METHOD",
    "PACKAGE",
    "SERVICE_NAME",
    "Event",
    "RequestRejected",
    "SendEventRequest",
    "SendEventResponse",
    "Status",
    "decode_request",
    "decode_request_json",
    "encode_response",
    "encode_response_json",
    "error_response",
    "error_response_bytes",
    "error_response_json",
    "file_descriptor",
    "ok_response",
    "ok_response_bytes",
    "ok_response_json",
    "response_json",
]

PACKAGE: Final = "raystack.raccoon.v1beta1"
SERVICE_NAME: Final = f"{PACKAGE}.EventService"
METHOD: Final = f"/{SERVICE_NAME}/SendEvent"
CONTENT_TYPE: Final = "application/x-protobuf"
"""Content type recorded for every Raccoon event: its bytes are a serialized proto message,
whichever encoding carried the request."""


class Status(IntEnum):
    """Raccoon's ``Status`` (the codes are ``headwater.collector.errors.Code``)."""

    UNSPECIFIED = 0
    SUCCESS = 1
    ERROR = 2


# --- the descriptor ----------------------------------------------------------------------------

_F = descriptor_pb2.FieldDescriptorProto


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``raystack/raccoon/v1beta1/raccoon.proto`` as a ``FileDescriptorProto``."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="raystack/raccoon/v1beta1/raccoon.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )

    def field(
        msg: descriptor_pb2.DescriptorProto,
        name: str,
        number: int,
        kind: int,
        json_name: str,
        type_name: str = "",
        label: int = _F.LABEL_OPTIONAL,
    ) -> None:
        f = msg.field.add(name=name, number=number, type=kind, label=label, json_name=json_name)
        if type_name:
            f.type_name = type_name

    req = fd.message_type.add(name="SendEventRequest")
    field(req, "req_guid", 1, _F.TYPE_STRING, "reqGuid")
    field(req, "sent_time", 2, _F.TYPE_MESSAGE, "sentTime", ".google.protobuf.Timestamp")
    field(req, "events", 3, _F.TYPE_MESSAGE, "events", f".{PACKAGE}.Event", _F.LABEL_REPEATED)

    event = fd.message_type.add(name="Event")
    field(event, "event_bytes", 1, _F.TYPE_BYTES, "eventBytes")
    field(event, "type", 2, _F.TYPE_STRING, "type")

    resp = fd.message_type.add(name="SendEventResponse")
    field(resp, "status", 1, _F.TYPE_ENUM, "status", f".{PACKAGE}.Status")
    field(resp, "code", 2, _F.TYPE_ENUM, "code", f".{PACKAGE}.Code")
    field(resp, "sent_time", 3, _F.TYPE_INT64, "sentTime")
    field(resp, "reason", 4, _F.TYPE_STRING, "reason")
    data_type = f".{PACKAGE}.SendEventResponse.DataEntry"
    field(resp, "data", 5, _F.TYPE_MESSAGE, "data", data_type, _F.LABEL_REPEATED)
    entry = resp.nested_type.add(name="DataEntry")
    entry.options.map_entry = True
    field(entry, "key", 1, _F.TYPE_STRING, "key")
    field(entry, "value", 2, _F.TYPE_STRING, "value")

    status = fd.enum_type.add(name="Status")
    for s in Status:
        status.value.add(name=f"STATUS_{s.name}", number=s.value)
    code = fd.enum_type.add(name="Code")
    for c in Code:
        code.value.add(name=f"CODE_{c.name}", number=c.value)

    service = fd.service.add(name="EventService")
    service.method.add(
        name="SendEvent",
        input_type=f".{PACKAGE}.SendEventRequest",
        output_type=f".{PACKAGE}.SendEventResponse",
    )
    return fd


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    timestamp = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(timestamp)
    pool.Add(timestamp)
    pool.Add(file_descriptor())
    return pool


_POOL: Final = _build_pool()


def _message_class(name: str) -> type[Message]:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


SendEventRequest: Final = _message_class("SendEventRequest")
Event: Final = _message_class("Event")
SendEventResponse: Final = _message_class("SendEventResponse")

# --- refusals ----------------------------------------------------------------------------------


class RequestRejected(Rejected):
    """A bad request whose ``req_guid`` was read: the error response names the request."""

    def __init__(self, reason: str, req_guid: str, kind: str) -> None:
        base = bad_request(reason, kind)
        super().__init__(
            base.reason,
            status=base.status,
            code=base.code,
            retry_after=base.retry_after,
            kind=base.kind,
        )
        self.req_guid = req_guid


def _refuse(reason: str, kind: str, req_guid: str = "") -> Rejected:
    if req_guid:
        return RequestRejected(reason, req_guid, kind)
    return bad_request(reason, kind)


def _too_many(n: int, limits: LimitsConfig, req_guid: str) -> Rejected:
    return _refuse(
        f"the batch has {n} events; the limit is {limits.max_batch_events} "
        "(collector.limits.max_batch_events)",
        "too_many_events",
        req_guid,
    )


# --- timestamps --------------------------------------------------------------------------------

_MIN_SECONDS: Final = -62_135_596_800  # 0001-01-01T00:00:00Z
_MAX_SECONDS: Final = 253_402_300_799  # 9999-12-31T23:59:59Z
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_ORDINAL: Final = _EPOCH.toordinal()


def _timestamp_problem(seconds: int, nanos: int) -> str | None:
    if not _MIN_SECONDS <= seconds <= _MAX_SECONDS:
        return f"seconds {seconds} is outside 0001-01-01..9999-12-31"
    if not 0 <= nanos <= 999_999_999:
        return f"nanos {nanos} is outside 0..999999999"
    return None


def _rfc3339(seconds: int, nanos: int) -> str:
    """A valid timestamp as RFC 3339 in UTC, with 0, 3, 6 or 9 fractional digits."""
    d = _EPOCH + timedelta(seconds=seconds)
    text = f"{d.year:04d}-{d.month:02d}-{d.day:02d}T{d.hour:02d}:{d.minute:02d}:{d.second:02d}"
    if nanos:
        if nanos % 1_000_000 == 0:
            text += f".{nanos // 1_000_000:03d}"
        elif nanos % 1000 == 0:
            text += f".{nanos // 1000:06d}"
        else:
            text += f".{nanos:09d}"
    return text + "Z"


_RFC3339: Final = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:[Zz]|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)


def _parse_rfc3339(text: str) -> tuple[int, int] | str:
    """(seconds, nanos) of an RFC 3339 timestamp, or what is wrong with it."""
    m = _RFC3339.fullmatch(text) if len(text) <= 40 else None
    if m is None:
        return "not an RFC 3339 timestamp such as 2024-05-01T12:30:00.250Z"
    year, month, day, hour, minute, second, frac, sign, oh, om = m.groups()
    try:
        dt = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second))
    except ValueError as e:
        return f"not a valid time ({e})"
    seconds = (dt.toordinal() - _EPOCH_ORDINAL) * 86400 + dt.hour * 3600 + dt.minute * 60
    seconds += dt.second
    if sign:
        if int(oh) > 23 or int(om) > 59:
            return f"the offset {sign}{oh}:{om} is not valid"
        offset = int(oh) * 3600 + int(om) * 60
        seconds += -offset if sign == "+" else offset
    nanos = int(frac.ljust(9, "0")) if frac else 0
    problem = _timestamp_problem(seconds, nanos)
    return problem if problem is not None else (seconds, nanos)


# --- binary requests ---------------------------------------------------------------------------

_parse: Final = SendEventRequest.FromString
_new_tuple: Final = tuple.__new__


def decode_request(data: bytes, limits: LimitsConfig) -> Intake:
    """The events of a binary ``SendEventRequest``; ``Rejected`` says why it cannot be taken.

    Sizes of the whole message are the transport's to enforce (frame, body and gRPC limits
    differ); the number of events is checked here.
    """
    try:
        req: Any = _parse(data)
    except DecodeError as e:
        reason, guid = _diagnose(bytes(data))
        if reason is None:
            reason = str(e).rpartition(": ")[2] or "the parser could not read it"
        raise _refuse(f"malformed protobuf: {reason}", "malformed", guid) from None
    guid: str = req.req_guid
    events = req.events
    n = len(events)
    if not n:
        raise _refuse("the request has no events", "empty", guid)
    if n > limits.max_batch_events:
        raise _too_many(n, limits, guid)
    ctype = CONTENT_TYPE
    out: list[EventIn] = [_new_tuple(EventIn, (e.type, e.event_bytes, ctype, None)) for e in events]
    if not all(map(event_type, out)):
        i = next(i for i, e in enumerate(out) if not e.type)
        raise _refuse(f"events[{i}] has an empty type", "bad_type", guid)
    meta: dict[str, str] = {}
    if req.HasField("sent_time"):
        seconds, nanos = req.sent_time.seconds, req.sent_time.nanos
        problem = _timestamp_problem(seconds, nanos)
        if problem is not None:
            raise _refuse(f"sent_time is not a valid timestamp: {problem}", "bad_sent_time", guid)
        meta["sent_time"] = _rfc3339(seconds, nanos)
    return Intake(out, guid or None, meta)


# Known fields for the diagnosis of unreadable requests: number -> (name, kind, nested schema).
_Schema = dict[int, tuple[str, str, "_Schema | None"]]
_TIMESTAMP_SCHEMA: Final[_Schema] = {1: ("seconds", "varint", None), 2: ("nanos", "varint", None)}
_EVENT_SCHEMA: Final[_Schema] = {1: ("event_bytes", "bytes", None), 2: ("type", "string", None)}
_REQUEST_SCHEMA: Final[_Schema] = {
    1: ("req_guid", "string", None),
    2: ("sent_time", "message", _TIMESTAMP_SCHEMA),
    3: ("events", "repeated", _EVENT_SCHEMA),
}
_MAX_DEPTH: Final = 100  # the parser's own nesting limit


class _Corrupt(Exception):
    pass


def _varint(buf: bytes, pos: int, end: int, what: str, most: int = 10) -> tuple[int, int]:
    """A varint of at most ``most`` bytes (the parser reads tags and lengths in 5)."""
    value = shift = 0
    start = pos
    while True:
        if pos >= end:
            raise _Corrupt(f"at byte {start}: the {what} varint is cut off by the end of its data")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 7 * most:
            raise _Corrupt(f"at byte {start}: the {what} varint is longer than {most} bytes")


def _diagnose(buf: bytes) -> tuple[str | None, str]:
    """The first problem in a request the parser refused, and its req_guid if one was read."""
    found: dict[str, str] = {}
    try:
        _walk(buf, 0, len(buf), _REQUEST_SCHEMA, "", 0, None, found)
    except _Corrupt as e:
        return str(e), found.get("req_guid", "")
    return None, found.get("req_guid", "")


def _walk(
    buf: bytes,
    pos: int,
    end: int,
    schema: _Schema | None,
    path: str,
    depth: int,
    group: int | None,
    found: dict[str, str],
) -> int:
    """Check one message (or group) of ``buf[pos:end]``; returns where it ended."""
    if depth > _MAX_DEPTH:
        raise _Corrupt(f"at byte {pos}: messages are nested more than {_MAX_DEPTH} levels deep")
    counts: dict[int, int] = {}
    while pos < end:
        at = pos
        tag, pos = _varint(buf, pos, end, "field tag", 5)
        number, wire = tag >> 3, tag & 7
        if tag > 0xFFFFFFFF:
            raise _Corrupt(f"at byte {at}: field tag {tag} is larger than 32 bits")
        if number == 0:
            raise _Corrupt(f"at byte {at}: field number 0 is not allowed")
        known = schema.get(number) if schema is not None and group is None else None
        if known is not None and wire != (0 if known[1] == "varint" else 2):
            known = None  # the parser takes a field with another wire type as unknown
        name = f"{path}.field {number}" if path else f"field {number}"
        if known is not None:
            index = counts.get(number, 0)
            counts[number] = index + 1
            name = known[0] if known[1] != "repeated" else f"{known[0]}[{index}]"
            name = f"{path}.{name}" if path else name
        where = f"at byte {at} ({name})"
        if wire == 0:
            _, pos = _varint(buf, pos, end, name)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > end:
                article = "an" if width == 8 else "a"
                raise _Corrupt(
                    f"{where}: {article} {width}-byte value is cut off by the end of its data"
                )
            pos += width
        elif wire == 2:
            length, pos = _varint(buf, pos, end, f"{name} length", 5)
            if length > end - pos:
                raise _Corrupt(
                    f"{where}: the field declares {length} bytes but its data ends "
                    f"{end - pos} bytes later"
                )
            if known is not None:
                kind, nested = known[1], known[2]
                if kind == "string":
                    try:
                        value = buf[pos : pos + length].decode()
                    except UnicodeDecodeError as e:
                        raise _Corrupt(
                            f"{where}: the text is not valid UTF-8 ({e.reason})"
                        ) from None
                    if not path:
                        found[known[0]] = value
                elif nested is not None:
                    _walk(buf, pos, pos + length, nested, name, depth + 1, None, found)
            pos += length
        elif wire == 3:
            pos = _walk(buf, pos, end, None, name, depth + 1, number, found)
        elif wire == 4:
            if group is None:
                raise _Corrupt(
                    f"at byte {at}: an end-group tag (field {number}) with no open group"
                )
            if number != group:
                raise _Corrupt(
                    f"at byte {at}: an end-group tag for field {number} closes a group of "
                    f"field {group}"
                )
            return pos
        else:
            raise _Corrupt(f"{where}: wire type {wire} does not exist")
    if group is not None:
        raise _Corrupt(f"at byte {pos}: the group of field {group} is never closed")
    return pos


# --- JSON requests -----------------------------------------------------------------------------

_REQUEST_KEYS: Final = {
    "req_guid": "req_guid",
    "reqGuid": "req_guid",
    "sent_time": "sent_time",
    "sentTime": "sent_time",
    "events": "events",
}
_EVENT_KEYS: Final = {"event_bytes", "eventBytes", "type"}
_a2b: Final = binascii.a2b_base64
_URLSAFE: Final = str.maketrans("-_", "+/")


def _kind(value: object) -> str:
    """``value``'s JSON type for an error message: "null", "a number", "an array"..."""
    return "null" if value is None else with_article(json_kind(value))


def decode_request_json(data: bytes | str, limits: LimitsConfig) -> Intake:
    """The events of a ``SendEventRequest`` in protobuf's JSON mapping (see the module doc)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise bad_request("invalid JSON: nested too deeply", "invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad_request(
            f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}", "invalid_json"
        ) from None
    except UnicodeDecodeError as e:
        raise bad_request(
            f"invalid JSON: the text is not valid {e.encoding} ({e.reason} at byte {e.start})",
            "invalid_json",
        ) from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise bad_request(f"invalid JSON: {e}", "invalid_json") from None
    if type(doc) is not dict:
        raise bad_request(f"the request must be a JSON object, not {_kind(doc)}", "invalid_json")

    fields: dict[str, Any] = {}
    for key, value in doc.items():
        name = _REQUEST_KEYS.get(key)
        if name is None:
            raise _refuse(
                f"unknown field {key[:80]!r} in the request (expected req_guid, sent_time, events)",
                "invalid_json",
                _guid_of(doc),
            )
        if name in fields:
            raise _refuse(f"{name} is given twice", "invalid_json", _guid_of(doc))
        fields[name] = value

    guid = fields.get("req_guid")
    if guid is None:
        guid = ""
    elif type(guid) is not str:
        raise bad_request(f"req_guid must be a string, not {_kind(guid)}", "invalid_json")
    elif not guid.isascii():
        _check_text(guid, "req_guid", "")

    events = fields.get("events")
    if events is None:
        events = []
    elif type(events) is not list:
        raise _refuse(f"events must be an array, not {_kind(events)}", "invalid_json", guid)
    n = len(events)
    if not n:
        raise _refuse("the request has no events", "empty", guid)
    if n > limits.max_batch_events:
        raise _too_many(n, limits, guid)

    out: list[EventIn] = []
    append = out.append
    ctype = CONTENT_TYPE
    for i, ev in enumerate(events):
        if type(ev) is not dict:
            raise _refuse(f"events[{i}] must be an object, not {_kind(ev)}", "invalid_json", guid)
        t = ev.get("type")
        if "event_bytes" in ev:
            b = ev["event_bytes"]
            known = 2 if "type" in ev else 1
        elif "eventBytes" in ev:
            b = ev["eventBytes"]
            known = 2 if "type" in ev else 1
        else:
            b = None
            known = 1 if "type" in ev else 0
        if len(ev) != known:
            raise _event_keys_problem(i, ev, guid)
        if type(t) is not str:
            if t is not None:
                raise _refuse(
                    f"events[{i}].type must be a string, not {_kind(t)}", "invalid_json", guid
                )
            t = ""
        if not t:
            raise _refuse(f"events[{i}] has an empty type", "bad_type", guid)
        if not t.isascii():
            _check_text(t, f"events[{i}].type", guid)
        if type(b) is str:
            try:
                value = _a2b(b, strict_mode=True)
            except ValueError:
                value = _base64_lenient(b, i, guid)
        elif b is None:
            value = b""
        else:
            raise _refuse(
                f"events[{i}].event_bytes must be a base64 string, not {_kind(b)}",
                "invalid_json",
                guid,
            )
        append(_new_tuple(EventIn, (t, value, ctype, None)))

    meta: dict[str, str] = {}
    sent = fields.get("sent_time")
    if sent is not None:
        meta["sent_time"] = _json_sent_time(sent, guid)
    return Intake(out, guid or None, meta)


def _guid_of(doc: dict[str, Any]) -> str:
    for key in ("req_guid", "reqGuid"):
        value = doc.get(key)
        if type(value) is str and (value.isascii() or _is_text(value)):
            return value
    return ""


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_text(value: str, name: str, guid: str) -> None:
    """JSON may escape lone surrogates (``"\\ud800"``), which no UTF-8 text can hold."""
    if not _is_text(value):
        raise _refuse(
            f"{name} holds a lone surrogate, which is not Unicode text", "invalid_json", guid
        )


def _event_keys_problem(i: int, ev: dict[str, Any], guid: str) -> Rejected:
    unknown = [k for k in ev if k not in _EVENT_KEYS]
    if unknown:
        return _refuse(
            f"unknown field {unknown[0][:80]!r} in events[{i}] (expected event_bytes, type)",
            "invalid_json",
            guid,
        )
    return _refuse(
        f"events[{i}].event_bytes is given twice (as event_bytes and eventBytes)",
        "invalid_json",
        guid,
    )


def _base64_lenient(text: str, i: int, guid: str) -> bytes:
    """The JSON mapping also takes URL-safe base64 and leaves padding optional."""
    problem = "it holds characters that are not ASCII"
    if text.isascii():
        std = text.translate(_URLSAFE)
        if "=" not in std:
            std += "=" * (-len(std) % 4)
        try:
            return _a2b(std, strict_mode=True)
        except ValueError as e:
            problem = str(e)
    raise _refuse(f"events[{i}].event_bytes is not valid base64: {problem}", "invalid_json", guid)


def _json_sent_time(value: object, guid: str) -> str:
    if type(value) is str:
        parsed = _parse_rfc3339(value)
        if isinstance(parsed, str):
            raise _refuse(
                f"sent_time {value[:60]!r} is {parsed}"
                if parsed.startswith("not")
                else f"sent_time {value[:60]!r}: {parsed}",
                "bad_sent_time",
                guid,
            )
        return _rfc3339(*parsed)
    if type(value) is dict:
        unknown = [k for k in value if k not in ("seconds", "nanos")]
        if unknown:
            raise _refuse(
                f"unknown field {unknown[0][:80]!r} in sent_time (expected seconds, nanos)",
                "bad_sent_time",
                guid,
            )
        parts = []
        for part in ("seconds", "nanos"):
            v = value.get(part, 0)
            if v is None:
                v = 0
            if type(v) is not int:
                raise _refuse(
                    f"sent_time.{part} must be an integer, not {_kind(v)}", "bad_sent_time", guid
                )
            parts.append(v)
        problem = _timestamp_problem(parts[0], parts[1])
        if problem is not None:
            raise _refuse(f"sent_time is not a valid timestamp: {problem}", "bad_sent_time", guid)
        return _rfc3339(parts[0], parts[1])
    raise _refuse(
        "sent_time must be an RFC 3339 string or {seconds, nanos}, not " + _kind(value),
        "bad_sent_time",
        guid,
    )


# --- responses ---------------------------------------------------------------------------------


def _seconds(sent_time_ms: int | None) -> int:
    if sent_time_ms is None:
        return time.time_ns() // 1_000_000_000
    return sent_time_ms // 1000


def _response(
    status: int, code: int, reason: str, data: dict[str, str], sent_time_ms: int | None
) -> Message:
    return SendEventResponse(
        status=int(status),
        code=int(code),
        sent_time=_seconds(sent_time_ms),
        reason=reason,
        data=data,
    )


def encode_response(
    status: int,
    code: int,
    reason: str,
    data: dict[str, str],
    sent_time_ms: int | None = None,
) -> bytes:
    """A binary ``SendEventResponse``. ``sent_time_ms`` (default now) is written in seconds,
    as Raccoon does."""
    return _response(status, code, reason, data, sent_time_ms).SerializeToString(deterministic=True)


def encode_response_json(
    status: int,
    code: int,
    reason: str,
    data: dict[str, str],
    sent_time_ms: int | None = None,
) -> str:
    """A ``SendEventResponse`` in JSON as Raccoon's server writes it (see the module doc)."""
    doc: dict[str, object] = {
        "status": int(status),
        "code": int(code),
        "sent_time": _seconds(sent_time_ms),
    }
    if reason:
        doc["reason"] = reason
    doc["data"] = data
    return json.dumps(doc, separators=(",", ":"))


def response_json(response: Message) -> str:
    """A ``SendEventResponse`` message in JSON as ``encode_response_json`` writes it."""
    r: Any = response
    return encode_response_json(r.status, r.code, r.reason, dict(r.data), r.sent_time * 1000)


def ok_response(req_guid: str, sent_time_ms: int | None = None) -> Message:
    """The success response to request ``req_guid``."""
    return _response(Status.SUCCESS, Code.OK, "", {"req_guid": req_guid}, sent_time_ms)


def _error_parts(rejected: Rejected, req_guid: str | None) -> tuple[int, str, dict[str, str]]:
    if req_guid is None:
        req_guid = rejected.req_guid if isinstance(rejected, RequestRejected) else ""
    data = {"req_guid": req_guid}
    if rejected.retry_after is not None:
        data["retry_after"] = str(rejected.retry_after)
    return int(rejected.code), rejected.reason, data


def error_response(
    rejected: Rejected, req_guid: str | None = None, sent_time_ms: int | None = None
) -> Message:
    """The error response for ``rejected``: its code and reason, ``data`` with the request's
    ``req_guid`` (given, or carried by a ``RequestRejected``, else "") and, for backpressure,
    ``retry_after`` in seconds."""
    code, reason, data = _error_parts(rejected, req_guid)
    return _response(Status.ERROR, code, reason, data, sent_time_ms)


def ok_response_bytes(req_guid: str, sent_time_ms: int | None = None) -> bytes:
    return encode_response(Status.SUCCESS, Code.OK, "", {"req_guid": req_guid}, sent_time_ms)


def ok_response_json(req_guid: str, sent_time_ms: int | None = None) -> str:
    return encode_response_json(Status.SUCCESS, Code.OK, "", {"req_guid": req_guid}, sent_time_ms)


def error_response_bytes(
    rejected: Rejected, req_guid: str | None = None, sent_time_ms: int | None = None
) -> bytes:
    code, reason, data = _error_parts(rejected, req_guid)
    return encode_response(Status.ERROR, code, reason, data, sent_time_ms)


def error_response_json(
    rejected: Rejected, req_guid: str | None = None, sent_time_ms: int | None = None
) -> str:
    code, reason, data = _error_parts(rejected, req_guid)
    return encode_response_json(Status.ERROR, code, reason, data, sent_time_ms)
