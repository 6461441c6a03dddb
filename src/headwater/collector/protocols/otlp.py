"""OTLP/HTTP logs (``POST /v1/logs``): an ``ExportLogsServiceRequest`` in protobuf
(``application/x-protobuf``) or in OTLP's JSON encoding (``application/json``).

Each LogRecord becomes one event of type ``log`` (whatever its ``event_name``: routing by
event name would scatter one service's logs over as many topics as it has event names; the
name stays in the value). The value is compact JSON carrying the record with its resource and
scope, so every event stands alone::

    {"time_unix_nano", "observed_time_unix_nano", "severity_number", "severity_text", "body",
     "attributes", "dropped_attributes_count", "flags", "trace_id", "span_id",
     "event_name" (only when set),
     "resource": {"attributes", "dropped_attributes_count", "schema_url"},
     "scope": {"name", "version", "attributes", "dropped_attributes_count", "schema_url"}}

AnyValues become plain JSON: strings, booleans, integers, doubles (NaN and the infinities as the
strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, as protobuf's JSON mapping writes them),
bytes as base64, arrays as arrays, key-value lists as objects (a repeated key keeps its last
value). Ids are lowercase hex (``""`` when unset); a record's trace id, when set, is its
partition key so one trace's logs stay in order.

The JSON encoding is read directly rather than through ``google.protobuf.json_format`` (pure
Python, about ten times slower), following the OTLP specification: field names in lowerCamelCase
(the proto's snake_case names accepted too), trace and span ids in hex, other bytes in base64,
64-bit integers as decimal strings or numbers, enums as integers (or their names), unknown fields
ignored. Both encodings give the same events.

A request is taken whole or refused whole (no partial success), with a reason naming the field
(``resourceLogs[0].scopeLogs[1].logRecords[2].traceId ...``); an id of the wrong length refuses
the request, as the OpenTelemetry Collector does.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import SeverityNumber

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected, bad_request, too_large
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols.body import dump_json, json_kind, parse_json, show_value

EVENT_TYPE = "log"
CONTENT_TYPE = "application/json"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_MEDIA = {"application/x-protobuf": PROTOBUF, "application/protobuf": PROTOBUF, JSON: JSON}
_ID_BYTES = {"traceId": 16, "spanId": 8}
_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
_MAX_DEPTH = 100  # nested AnyValues, as protobuf's own parser allows

# google.rpc.Code values for the Status an OTLP/HTTP error response carries.
_RPC_CODE = {400: 3, 401: 16, 403: 7, 404: 5, 413: 8, 415: 3, 429: 8, 503: 14}

Record = tuple[str, dict[str, Any]]  # where it came from, its event value


def media_type(content_type: str | None) -> str:
    """The OTLP encoding a Content-Type names; ``Rejected`` (415) when it names none."""
    media = (content_type or "").partition(";")[0].strip().lower()
    found = _MEDIA.get(media)
    if found is None:
        raise Rejected(
            f"Content-Type {(content_type or '')[:60]!r} is not an OTLP encoding "
            f"(use {PROTOBUF} or {JSON})",
            status=415,
            kind="unsupported_media_type",
        )
    return found


def decode_otlp_logs(body: bytes, content_type: str, limits: LimitsConfig) -> Intake:
    """Decode an OTLP/HTTP logs export into one ``log`` event per LogRecord."""
    if media_type(content_type) == PROTOBUF:
        records = _from_protobuf(body, limits.max_batch_events)
    else:
        records = _from_json(body, limits.max_batch_events)
    return Intake(
        [
            EventIn(
                EVENT_TYPE,
                dump_json(value, where + ": "),
                CONTENT_TYPE,
                value["trace_id"].encode() or None,
            )
            for where, value in records
        ],
        None,
        {},
    )


def encode_otlp_response(content_type: str | None) -> tuple[bytes, str]:
    """The body and Content-Type of a success: an empty ``ExportLogsServiceResponse`` in the
    request's encoding (protobuf when the request's is unknown)."""
    if _encoding_or_protobuf(content_type) == JSON:
        return b"{}", JSON
    return b"", PROTOBUF


def encode_otlp_status(content_type: str | None, rejected: Rejected) -> tuple[bytes, str]:
    """The body and Content-Type of a refusal: a ``google.rpc.Status`` with the reason, in the
    request's encoding, as OTLP/HTTP specifies for 4xx/5xx answers."""
    code = _RPC_CODE.get(rejected.status, 2)  # 2: UNKNOWN
    if _encoding_or_protobuf(content_type) == JSON:
        return dump_json({"code": code, "message": rejected.reason}, ""), JSON
    message = rejected.reason.encode()
    return b"\x08" + _varint(code) + b"\x12" + _varint(len(message)) + message, PROTOBUF


def _encoding_or_protobuf(content_type: str | None) -> str:
    try:
        return media_type(content_type)
    except Rejected:
        return PROTOBUF


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _too_many(count: int, limit: int) -> Rejected:
    return too_large(
        f"the request has {count} log records, more than {limit} "
        "(collector.limits.max_batch_events)"
    )


def _value(
    rec: dict[str, Any], resource: dict[str, Any], scope: dict[str, Any], event_name: str
) -> dict[str, Any]:
    if event_name:
        rec["event_name"] = event_name
    rec["resource"] = resource
    rec["scope"] = scope
    return rec


def _double(d: float) -> float | str:
    if math.isfinite(d):
        return d
    return _NONFINITE.get(d, "NaN")


# --- protobuf ------------------------------------------------------------------------------------


def _from_protobuf(body: bytes, limit: int) -> list[Record]:
    request = ExportLogsServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as e:
        raise bad_request(
            f"OTLP protobuf body is malformed: {_why(e)}", kind="bad_protobuf"
        ) from None
    count = sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)
    if count > limit:
        raise _too_many(count, limit)
    out: list[Record] = []
    for ri, rl in enumerate(request.resource_logs):
        resource = {
            "attributes": _attributes(rl.resource.attributes),
            "dropped_attributes_count": rl.resource.dropped_attributes_count,
            "schema_url": rl.schema_url,
        }
        for si, sl in enumerate(rl.scope_logs):
            scope = {
                "name": sl.scope.name,
                "version": sl.scope.version,
                "attributes": _attributes(sl.scope.attributes),
                "dropped_attributes_count": sl.scope.dropped_attributes_count,
                "schema_url": sl.schema_url,
            }
            for li, r in enumerate(sl.log_records):
                where = f"resourceLogs[{ri}].scopeLogs[{si}].logRecords[{li}]"
                rec = {
                    "time_unix_nano": r.time_unix_nano,
                    "observed_time_unix_nano": r.observed_time_unix_nano,
                    "severity_number": r.severity_number,
                    "severity_text": r.severity_text,
                    "body": _any(r.body) if r.HasField("body") else None,
                    "attributes": _attributes(r.attributes),
                    "dropped_attributes_count": r.dropped_attributes_count,
                    "flags": r.flags,
                    "trace_id": _id_hex(r.trace_id, "traceId", where),
                    "span_id": _id_hex(r.span_id, "spanId", where),
                }
                out.append((where, _value(rec, resource, scope, r.event_name)))
    return out


def _why(e: Exception) -> str:
    """The parser's reason without the message-type preamble."""
    why = str(e)
    _, sep, rest = why.partition("ExportLogsServiceRequest': ")
    return (rest if sep else why)[:300]


def _id_hex(raw: bytes, name: str, where: str) -> str:
    if raw and len(raw) != _ID_BYTES[name]:
        raise bad_request(
            f"{where}.{name} is {len(raw)} bytes; it must be {_ID_BYTES[name]} (or empty)",
            kind="bad_protobuf",
        )
    return raw.hex()


def _attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _any(kv.value) for kv in kvs}


def _any(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "double_value":
        return _double(v.double_value)
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if kind == "array_value":
        return [_any(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return None  # unset (or a dictionary index, which logs do not use)


# --- JSON ----------------------------------------------------------------------------------------

_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_FLOAT = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?")
_SPECIAL_DOUBLES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_SEVERITY_NAMES = frozenset(SeverityNumber.keys())
_ANY_KINDS = {
    name: kind
    for kind in ("string", "bool", "int", "double", "array", "kvlist", "bytes")
    for name in (f"{kind}Value", f"{kind}_value")
}


@lru_cache(maxsize=64)
def _snake(camel: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), camel)


def _get(obj: dict[str, Any], camel: str) -> Any:
    """A field by its lowerCamelCase name, or by the proto's snake_case name."""
    value = obj.get(camel)
    if value is None:
        value = obj.get(_snake(camel))
    return value


def _bad(where: str, expected: str, value: Any) -> Rejected:
    return bad_request(f"{where} must be {expected}, got {show_value(value)}", kind="bad_json")


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(where, "an object", value)
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(where, "an array", value)
    return value


def _string(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(where, "a string", value)
    return value


def _integer(value: Any, where: str, lo: int, hi: int, what: str) -> int:
    """An integer field: a JSON number or a decimal string (64-bit values usually are)."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif (isinstance(value, float) and value.is_integer()) or (
        isinstance(value, str) and _DECIMAL.fullmatch(value)
    ):
        n = int(value)
    else:
        raise _bad(where, f"{what} (a number or a decimal string)", value)
    if not lo <= n <= hi:
        raise bad_request(f"{where} must be {what}, got {n}, out of range", kind="bad_json")
    return n


def _uint(value: Any, where: str, bits: int) -> int:
    return _integer(value, where, 0, (1 << bits) - 1, f"an unsigned {bits}-bit integer")


def _int64(value: Any, where: str) -> int:
    return _integer(value, where, -(1 << 63), (1 << 63) - 1, "a signed 64-bit integer")


def _severity(value: Any, where: str) -> int:
    if isinstance(value, str) and value in _SEVERITY_NAMES:
        return SeverityNumber.Value(value)
    return _integer(value, where, -(1 << 31), (1 << 31) - 1, "a severity number")


def _json_double(value: Any, where: str) -> float | str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _double(float(value))
    if isinstance(value, str):
        special = _SPECIAL_DOUBLES.get(value)
        if special is not None:
            return _double(special)
        if _FLOAT.fullmatch(value):
            return _double(float(value))
    raise _bad(where, "a number (or NaN, Infinity, -Infinity)", value)


def _json_bytes(value: Any, where: str) -> str:
    """base64 (standard or URL-safe, padded or not) as standard padded base64."""
    if not isinstance(value, str):
        raise _bad(where, "base64 text", value)
    text = value.replace("-", "+").replace("_", "/")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise _bad(where, "base64 text", value) from None
    return base64.b64encode(raw).decode()


def _json_id(value: Any, name: str, where: str) -> str:
    if value is None or value == "":
        return ""
    size = _ID_BYTES[name]
    if isinstance(value, str) and len(value) == 2 * size:
        try:
            return bytes.fromhex(value).hex()
        except ValueError:
            pass
    raise _bad(f"{where}.{name}", f"{2 * size} hex digits ({size} bytes)", value)


def _json_attributes(value: Any, where: str, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, kv in enumerate(_list(value, where)):
        here = f"{where}[{i}]"
        if not isinstance(kv, dict):
            raise _bad(here, "an object (KeyValue)", kv)
        out[_string(kv.get("key"), here + ".key")] = _json_any(
            kv.get("value"), here + ".value", depth
        )
    return out


def _json_any(value: Any, where: str, depth: int) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(where, "an object (AnyValue)", value)
    if depth >= _MAX_DEPTH:
        raise bad_request(f"{where} nests values deeper than {_MAX_DEPTH} levels", kind="bad_json")
    kind = field = None
    inner: Any = None
    for name, x in value.items():
        k = _ANY_KINDS.get(name)
        if k is None or x is None:
            continue  # unknown fields are ignored
        if kind is not None:
            raise bad_request(f"{where} sets both {field} and {name}", kind="bad_json")
        kind, field, inner = k, name, x
    here = f"{where}.{field}"
    if kind is None:
        return None
    if kind == "string":
        return _string(inner, here)
    if kind == "int":
        return _int64(inner, here)
    if kind == "bool":
        if not isinstance(inner, bool):
            raise _bad(here, "true or false", inner)
        return inner
    if kind == "double":
        return _json_double(inner, here)
    if kind == "bytes":
        return _json_bytes(inner, here)
    values = _list(_object(inner, here).get("values"), here + ".values")
    if kind == "array":
        return [_json_any(x, f"{here}.values[{i}]", depth + 1) for i, x in enumerate(values)]
    return _json_attributes(values, here + ".values", depth + 1)


def _from_json(body: bytes, limit: int) -> list[Record]:
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise bad_request(
            f"OTLP JSON body must be an object (ExportLogsServiceRequest), got {json_kind(doc)}",
            kind="bad_json",
        )
    out: list[Record] = []
    for ri, rl in enumerate(_list(_get(doc, "resourceLogs"), "resourceLogs")):
        w = f"resourceLogs[{ri}]"
        rl = _object(rl, w)
        res = _object(_get(rl, "resource"), w + ".resource")
        resource = {
            "attributes": _json_attributes(_get(res, "attributes"), w + ".resource.attributes"),
            "dropped_attributes_count": _uint(
                _get(res, "droppedAttributesCount"), w + ".resource.droppedAttributesCount", 32
            ),
            "schema_url": _string(_get(rl, "schemaUrl"), w + ".schemaUrl"),
        }
        for si, sl in enumerate(_list(_get(rl, "scopeLogs"), w + ".scopeLogs")):
            w2 = f"{w}.scopeLogs[{si}]"
            sl = _object(sl, w2)
            sc = _object(_get(sl, "scope"), w2 + ".scope")
            scope = {
                "name": _string(_get(sc, "name"), w2 + ".scope.name"),
                "version": _string(_get(sc, "version"), w2 + ".scope.version"),
                "attributes": _json_attributes(_get(sc, "attributes"), w2 + ".scope.attributes"),
                "dropped_attributes_count": _uint(
                    _get(sc, "droppedAttributesCount"), w2 + ".scope.droppedAttributesCount", 32
                ),
                "schema_url": _string(_get(sl, "schemaUrl"), w2 + ".schemaUrl"),
            }
            records = _list(_get(sl, "logRecords"), w2 + ".logRecords")
            if len(out) + len(records) > limit:
                raise _too_many(len(out) + len(records), limit)
            for li, r in enumerate(records):
                where = f"{w2}.logRecords[{li}]"
                r = _object(r, where)
                rec = {
                    "time_unix_nano": _uint(_get(r, "timeUnixNano"), where + ".timeUnixNano", 64),
                    "observed_time_unix_nano": _uint(
                        _get(r, "observedTimeUnixNano"), where + ".observedTimeUnixNano", 64
                    ),
                    "severity_number": _severity(
                        _get(r, "severityNumber"), where + ".severityNumber"
                    ),
                    "severity_text": _string(_get(r, "severityText"), where + ".severityText"),
                    "body": _json_any(_get(r, "body"), where + ".body", 0),
                    "attributes": _json_attributes(_get(r, "attributes"), where + ".attributes"),
                    "dropped_attributes_count": _uint(
                        _get(r, "droppedAttributesCount"), where + ".droppedAttributesCount", 32
                    ),
                    "flags": _uint(_get(r, "flags"), where + ".flags", 32),
                    "trace_id": _json_id(_get(r, "traceId"), "traceId", where),
                    "span_id": _json_id(_get(r, "spanId"), "spanId", where),
                }
                event_name = _string(_get(r, "eventName"), where + ".eventName")
                out.append((where, _value(rec, resource, scope, event_name)))
    return out
