"""OTLP/HTTP logs: what the OpenTelemetry Python SDK's exporter really sends, in protobuf and in
OTLP's JSON; the JSON each record becomes; responses the exporter accepts; bad input refused."""

from __future__ import annotations

import base64
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import (
    InMemoryLogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.resources import Resource

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected, bad_request
from headwater.collector.protocols.body import decode_body
from headwater.collector.protocols.otlp import (
    decode_otlp_logs,
    encode_otlp_response,
    encode_otlp_status,
)

LIMITS = LimitsConfig()
PROTO = "application/x-protobuf"
TRACE_ID = 0x5B8EFFF798038103D269B633813FC60C
SPAN_ID = 0xEEE19B7EC3C1B174
Request = tuple[str, dict[str, str], bytes]


@contextmanager
def otlp_receiver(
    answer: Callable[[Request], tuple[int, bytes, str]],
) -> Iterator[tuple[str, list[Request]]]:
    """A local HTTP server recording every POST and answering it with ``answer``."""
    seen: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            request = (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            seen.append(request)
            status, payload, media = answer(request)
            self.send_response(status)
            self.send_header("Content-Type", media)
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


def _ok(request: Request) -> tuple[int, bytes, str]:
    body, media = encode_otlp_response(request[1].get("content-type"))
    return 200, body, media


def _sdk_records() -> list[ReadableLogRecord]:
    """Log records as the SDK makes them: a resource, two scopes, every kind of body."""
    provider = LoggerProvider(
        resource=Resource.create({"service.name": "checkout", "deployment.environment": "prod"})
    )
    memory = InMemoryLogRecordExporter()
    provider.add_log_record_processor(SimpleLogRecordProcessor(memory))
    app = provider.get_logger("checkout.app", "1.4.2", attributes={"team": "payments"})
    lib = provider.get_logger("http.client")
    span = trace.NonRecordingSpan(
        trace.SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=trace.TraceFlags(1))
    )
    in_span = trace.set_span_in_context(span)
    app.emit(
        timestamp=1_700_000_000_123_456_789,
        observed_timestamp=1_700_000_000_223_456_789,
        severity_number=SeverityNumber.ERROR,
        severity_text="ERROR",
        body="payment declined",
        attributes={"order.id": 991, "amount": 12.5, "retry": True, "tags": ["a", "b"]},
        context=in_span,
    )
    app.emit(body={"user": "ann", "items": [1, 2.5, "x", False], "raw": b"\x00\xff"})
    lib.emit(
        body=["one", 2],
        event_name="http.request.done",
        severity_number=SeverityNumber.INFO,
        attributes={"http.status_code": 200},
    )
    provider.shutdown()
    return list(memory.get_finished_logs())


def _export(records: list[ReadableLogRecord], **options: Any) -> tuple[Any, list[Request]]:
    with otlp_receiver(options.pop("answer", _ok)) as (url, seen):
        exporter = OTLPLogExporter(endpoint=f"{url}/v1/logs", timeout=5, **options)
        result = exporter.export(records)
        exporter.shutdown()
    return result, seen


def _decode_request(request: Request) -> Any:
    _, headers, raw = request
    body = decode_body(raw, headers.get("content-encoding"), LIMITS.max_body_bytes)
    return decode_otlp_logs(body, headers["content-type"], LIMITS)


EXPECTED_FIRST = {
    "time_unix_nano": 1_700_000_000_123_456_789,
    "observed_time_unix_nano": 1_700_000_000_223_456_789,
    "severity_number": 17,
    "severity_text": "ERROR",
    "body": "payment declined",
    "attributes": {"order.id": 991, "amount": 12.5, "retry": True, "tags": ["a", "b"]},
    "dropped_attributes_count": 0,
    "flags": 1,
    "trace_id": f"{TRACE_ID:032x}",
    "span_id": f"{SPAN_ID:016x}",
}


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_the_sdk_exporter_delivers_and_accepts_our_answer(compression: Compression) -> None:
    result, seen = _export(_sdk_records(), compression=compression)
    assert result == LogRecordExportResult.SUCCESS
    [request] = seen
    path, headers, _ = request
    assert path == "/v1/logs"
    assert headers["content-type"] == PROTO
    intake = _decode_request(request)
    assert intake.request_id is None
    assert [e.type for e in intake.events] == ["log", "log", "log"]
    assert all(e.content_type == "application/json" for e in intake.events)
    first, second, third = (orjson.loads(e.value) for e in intake.events)

    resource = first.pop("resource")
    assert resource["attributes"]["service.name"] == "checkout"
    assert resource["attributes"]["deployment.environment"] == "prod"
    assert first.pop("scope") == {
        "name": "checkout.app",
        "version": "1.4.2",
        "attributes": {"team": "payments"},
        "dropped_attributes_count": 0,
        "schema_url": "",
    }
    assert first == EXPECTED_FIRST
    assert intake.events[0].key == f"{TRACE_ID:032x}".encode()

    assert second["body"] == {
        "user": "ann",
        "items": [1, 2.5, "x", False],
        "raw": base64.b64encode(b"\x00\xff").decode(),
    }
    assert second["trace_id"] == "" and intake.events[1].key is None
    assert "event_name" not in second
    assert third["event_name"] == "http.request.done"
    assert third["body"] == ["one", 2]
    assert third["scope"]["name"] == "http.client"
    assert third["resource"] == resource


def test_the_exporter_reads_our_refusal_as_a_failure() -> None:
    refusal = bad_request("OTLP protobuf body is malformed: test", kind="bad_protobuf")

    def refuse(request: Request) -> tuple[int, bytes, str]:
        body, media = encode_otlp_status(request[1].get("content-type"), refusal)
        return 400, body, media

    result, seen = _export(_sdk_records()[:1], answer=refuse)
    assert result == LogRecordExportResult.FAILURE
    assert len(seen) == 1  # a 400 is not retried


def test_otlp_json_decodes_to_the_same_events_as_protobuf() -> None:
    _, [request] = _export(_sdk_records())
    from_proto = [orjson.loads(e.value) for e in _decode_request(request).events]
    message = ExportLogsServiceRequest.FromString(request[2])
    doc = json_format.MessageToDict(message)  # camelCase, int64 as strings, ids in base64
    for rl in doc["resourceLogs"]:
        for sl in rl["scopeLogs"]:
            for rec in sl["logRecords"]:
                for name in ("traceId", "spanId"):
                    if name in rec:  # OTLP/JSON writes ids in hex
                        rec[name] = base64.b64decode(rec[name]).hex()
    intake = decode_otlp_logs(orjson.dumps(doc), "application/json; charset=utf-8", LIMITS)
    assert [orjson.loads(e.value) for e in intake.events] == from_proto


def test_otlp_json_as_the_specification_shows_it() -> None:
    body = b"""{
      "resourceLogs": [{
        "resource": {"attributes": [
          {"key": "service.name", "value": {"stringValue": "my.service"}}]},
        "scopeLogs": [{
          "scope": {"name": "my.library", "version": "1.0.0",
                    "attributes": [{"key": "my.scope.attribute", "value": {"stringValue": "x"}}]},
          "logRecords": [{
            "timeUnixNano": "1544712660300000000",
            "observedTimeUnixNano": 1544712660300000000,
            "severityNumber": 10,
            "severityText": "Information",
            "traceId": "5B8EFFF798038103D269B633813FC60C",
            "spanId": "EEE19B7EC3C1B174",
            "body": {"stringValue": "Example log record"},
            "attributes": [
              {"key": "string.attribute", "value": {"stringValue": "some string"}},
              {"key": "boolean.attribute", "value": {"boolValue": true}},
              {"key": "int.attribute", "value": {"intValue": "10"}},
              {"key": "double.attribute", "value": {"doubleValue": 637.704}},
              {"key": "array.attribute", "value": {"arrayValue": {"values": [
                {"stringValue": "many"}, {"stringValue": "values"}]}}},
              {"key": "map.attribute", "value": {"kvlistValue": {"values": [
                {"key": "some.map.key", "value": {"stringValue": "some value"}}]}}}
            ],
            "someFutureField": {"ignored": true}
          }]
        }],
        "schemaUrl": "https://opentelemetry.io/schemas/1.21.0"
      }]
    }"""
    [event] = decode_otlp_logs(body, "application/json", LIMITS).events
    value = orjson.loads(event.value)
    assert value["time_unix_nano"] == value["observed_time_unix_nano"] == 1544712660300000000
    assert value["trace_id"] == "5b8efff798038103d269b633813fc60c"
    assert value["span_id"] == "eee19b7ec3c1b174"
    assert value["severity_number"] == 10
    assert value["body"] == "Example log record"
    assert value["attributes"] == {
        "string.attribute": "some string",
        "boolean.attribute": True,
        "int.attribute": 10,
        "double.attribute": 637.704,
        "array.attribute": ["many", "values"],
        "map.attribute": {"some.map.key": "some value"},
    }
    assert value["resource"] == {
        "attributes": {"service.name": "my.service"},
        "dropped_attributes_count": 0,
        "schema_url": "https://opentelemetry.io/schemas/1.21.0",
    }
    assert value["scope"]["attributes"] == {"my.scope.attribute": "x"}


def _json_record(record: dict[str, Any]) -> bytes:
    doc = {"resourceLogs": [{"scopeLogs": [{"logRecords": [record]}]}]}
    return json.dumps(doc).encode()  # orjson would refuse to write the deepest ones


def test_otlp_json_accepts_what_the_protobuf_json_mapping_allows() -> None:
    record = {
        "time_unix_nano": 5,  # the proto's own field names work too
        "severityNumber": "SEVERITY_NUMBER_WARN",
        "traceId": None,
        "spanId": "",
        "body": {
            "kvlistValue": {
                "values": [
                    {"key": "i", "value": {"intValue": 7}},
                    {"key": "s", "value": {"int_value": "-9223372036854775808"}},
                    {"key": "d", "value": {"doubleValue": "-Infinity"}},
                    {"key": "e", "value": {"doubleValue": "1.5e3"}},
                    {"key": "b", "value": {"bytesValue": "AQI"}},  # unpadded
                    {"key": "u", "value": {"bytesValue": "-_8="}},  # URL-safe
                    {"key": "n", "value": {"stringValue": None, "boolValue": False}},
                    {"key": "x", "value": {}},
                ]
            }
        },
        "attributes": None,
    }
    [event] = decode_otlp_logs(_json_record(record), "application/json", LIMITS).events
    value = orjson.loads(event.value)
    assert (value["time_unix_nano"], value["severity_number"]) == (5, 13)
    assert (value["trace_id"], value["span_id"], event.key) == ("", "", None)
    assert value["body"] == {
        "i": 7,
        "s": -(2**63),
        "d": "-Infinity",
        "e": 1500.0,
        "b": "AQI=",
        "u": "+/8=",
        "n": False,
        "x": None,
    }
    assert value["attributes"] == {}


def _nested_json(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"stringValue": "leaf"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"body": {"stringValue": "a", "intValue": 1}}, ".body sets both stringValue and intValue"),
        ({"body": {"intValue": "1.5"}}, ".body.intValue must be a signed 64-bit integer"),
        (
            {"body": {"intValue": "9223372036854775808"}},
            ".body.intValue must be a signed 64-bit integer, got 9223372036854775808, out of range",
        ),
        ({"body": {"boolValue": "true"}}, ".body.boolValue must be true or false, got 'true'"),
        ({"body": {"bytesValue": "***"}}, ".body.bytesValue must be base64 text, got '***'"),
        ({"body": {"doubleValue": "fast"}}, ".body.doubleValue must be a number (or NaN"),
        ({"body": {"arrayValue": {"values": {}}}}, ".body.arrayValue.values must be an array"),
        ({"body": "text"}, ".body must be an object (AnyValue), got 'text'"),
        ({"body": _nested_json(100)}, ".values[0] nests values deeper than 100 levels"),
        ({"attributes": [{"key": 1, "value": {}}]}, ".attributes[0].key must be a string, got a"),
        ({"attributes": {"k": "v"}}, ".attributes must be an array, got an object"),
        ({"flags": -1}, ".flags must be an unsigned 32-bit integer, got -1, out of range"),
        ({"severityNumber": "LOUD"}, ".severityNumber must be a severity number"),
        ({"eventName": 3}, ".eventName must be a string, got a number"),
        ({"traceId": "5B8EFFF798038103D269B633813FC60"}, ".traceId must be 32 hex digits"),
    ],
)
def test_otlp_json_bad_fields_are_named(record: dict[str, Any], reason: str) -> None:
    with pytest.raises(Rejected) as info:
        decode_otlp_logs(_json_record(record), "application/json", LIMITS)
    assert info.value.status == 400
    prefix = "resourceLogs[0].scopeLogs[0].logRecords[0]"
    assert info.value.reason.startswith(prefix), info.value.reason
    assert reason in info.value.reason, info.value.reason


def test_otlp_json_nesting_up_to_the_limit_is_fine() -> None:
    [event] = decode_otlp_logs(
        _json_record({"body": _nested_json(99)}), "application/json", LIMITS
    ).events
    assert "leaf" in event.value.decode()


def _record(**fields: Any) -> bytes:
    request = ExportLogsServiceRequest(
        resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(log_records=[LogRecord(**fields)])])]
    )
    return request.SerializeToString()


def test_any_values_become_plain_json() -> None:
    def kv(key: str, **value: Any) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(**value))

    attributes = [
        kv("nan", double_value=math.nan),
        kv("inf", double_value=math.inf),
        kv("-inf", double_value=-math.inf),
        kv("big", int_value=-(2**63)),
        kv("bytes", bytes_value=b"\x01\x02"),
        kv("empty"),
        kv("nested", array_value=ArrayValue(values=[AnyValue(array_value=ArrayValue())])),
        kv("map", kvlist_value=KeyValueList(values=[kv("a", bool_value=False)])),
        kv("dup", string_value="first"),
        kv("dup", string_value="last"),
    ]
    [event] = decode_otlp_logs(_record(attributes=attributes), PROTO, LIMITS).events
    value = orjson.loads(event.value)
    assert value["attributes"] == {
        "nan": "NaN",
        "inf": "Infinity",
        "-inf": "-Infinity",
        "big": -(2**63),
        "bytes": "AQI=",
        "empty": None,
        "nested": [[]],
        "map": {"a": False},
        "dup": "last",
    }
    assert value["body"] is None


def test_an_empty_export_is_an_empty_intake() -> None:
    assert decode_otlp_logs(b"", PROTO, LIMITS).events == []
    assert decode_otlp_logs(b"{}", "application/json", LIMITS).events == []


def test_responses_in_the_requests_encoding() -> None:
    body, media = encode_otlp_response(PROTO)
    assert media == PROTO
    assert ExportLogsServiceResponse.FromString(body) == ExportLogsServiceResponse()
    assert encode_otlp_response("application/json") == (b"{}", "application/json")
    assert encode_otlp_response("text/plain")[1] == PROTO

    refusal = Rejected("too big", status=413, kind="too_large")
    body, media = encode_otlp_status(PROTO, refusal)
    status = status_pb2.Status.FromString(body)
    assert (media, status.code, status.message) == (PROTO, 8, "too big")
    body, media = encode_otlp_status("application/json", refusal)
    assert (media, orjson.loads(body)) == ("application/json", {"code": 8, "message": "too big"})
    long = bad_request("é" * 300)
    assert status_pb2.Status.FromString(encode_otlp_status(None, long)[0]).message == "é" * 300


@pytest.mark.parametrize(
    ("body", "content_type", "status", "reason"),
    [
        (b"", "text/plain", 415, "Content-Type 'text/plain' is not an OTLP encoding"),
        (b"", "", 415, "Content-Type '' is not an OTLP encoding"),
        (b"\x0a\x05\x0a", PROTO, 400, "OTLP protobuf body is malformed: "),
        (b"\xff\xff\xff", PROTO, 400, "OTLP protobuf body is malformed: "),
        (_record(trace_id=b"\x01" * 8), PROTO, 400, "resourceLogs[0].scopeLogs[0].logRecords[0]"),
        (_record(span_id=b"\x01" * 16), PROTO, 400, "resourceLogs[0].scopeLogs[0].logRecords[0]"),
        (_record(severity_text="Q").replace(b"Q", b"\xff"), PROTO, 400, "OTLP protobuf body is"),
        (b"", "application/json", 400, "body is empty"),
        (b"[]", "application/json", 400, "OTLP JSON body must be an object"),
        (b'{"resourceLogs": 5}', "application/json", 400, "resourceLogs must be an array, got a"),
        (
            b'{"resourceLogs":[{"scopeLogs":[{"logRecords":[{"traceId":"W47/95gDgQPSabYzgT/GDA=="}]}]}]}',
            "application/json",
            400,
            "resourceLogs[0].scopeLogs[0].logRecords[0].traceId must be 32 hex digits (16 bytes), "
            "got 'W47/95gDgQPSabYzgT/GDA=='",
        ),
        (
            b'{"resourceLogs":[{"scopeLogs":[{"logRecords":[{"spanId":"zzzzzzzzzzzzzzzz"}]}]}]}',
            "application/json",
            400,
            "resourceLogs[0].scopeLogs[0].logRecords[0].spanId must be 16 hex digits",
        ),
        (
            b'{"resourceLogs":[{"scopeLogs":[{"logRecords":[{"timeUnixNano":"soon"}]}]}]}',
            "application/json",
            400,
            "resourceLogs[0].scopeLogs[0].logRecords[0].timeUnixNano must be an unsigned 64-bit "
            "integer (a number or a decimal string), got 'soon'",
        ),
    ],
)
def test_bad_input(body: bytes, content_type: str, status: int, reason: str) -> None:
    with pytest.raises(Rejected) as info:
        decode_otlp_logs(body, content_type, LIMITS)
    assert info.value.status == status
    assert info.value.reason.startswith(reason), info.value.reason


def test_a_wrong_length_id_is_named() -> None:
    with pytest.raises(Rejected) as info:
        decode_otlp_logs(_record(trace_id=b"\x01" * 8), PROTO, LIMITS)
    assert info.value.reason == (
        "resourceLogs[0].scopeLogs[0].logRecords[0].traceId is 8 bytes; it must be 16 (or empty)"
    )


def test_too_many_records() -> None:
    records = [LogRecord(severity_text=str(i)) for i in range(4)]
    body = ExportLogsServiceRequest(
        resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(log_records=records)])]
    ).SerializeToString()
    with pytest.raises(Rejected) as info:
        decode_otlp_logs(body, PROTO, LimitsConfig(max_batch_events=3))
    assert info.value.status == 413
    assert info.value.reason == (
        "the request has 4 log records, more than 3 (collector.limits.max_batch_events)"
    )
