"""Real clients, unmodified, over real sockets against the running collector on an embedded log:
Segment's analytics-python, the OpenTelemetry SDK's OTLP/HTTP log exporter, plain HTTP clients
speaking Jitsu's APIs, and the ``websockets`` library speaking Raccoon.

What a client sent is captured on its way out (the Segment SDK's HTTP session is wrapped, so the
comparison is with the exact bytes on the wire) and compared with the values on the log.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
import requests
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    LogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from segment.analytics import Client
from segment.analytics import request as segment_request
from segment.analytics.request import APIError
from segment.analytics.version import VERSION as SEGMENT_VERSION
from websockets.asyncio.client import connect as ws_connect

from headwater.bus import context
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.records import Record
from headwater.collector.auth import hash_key
from headwater.collector.config import CollectorConfig, SourceConfig
from headwater.collector.protocols import raccoon
from headwater.testing.clients import raccoon_request, raccoon_response
from headwater.testing.collector import RunningCollector, running_collector

KEY = "sdk-write-key"
CONFIG = CollectorConfig(sources=[SourceConfig(id="web", write_keys=[hash_key(KEY)])])
TIMEOUT_S = 10


@pytest.fixture
def server(bus: EmbeddedBus) -> Iterator[RunningCollector]:
    with running_collector(bus, CONFIG) as running:
        yield running


def records(bus: EmbeddedBus, topic: str) -> list[Record]:
    info = bus.topic(topic)
    return [r for p in range(info.partitions) for r in bus.read(topic, p, 0, 100_000)]


def all_records(bus: EmbeddedBus) -> list[Record]:
    return [r for t in bus.topics() for r in records(bus, t.name)]


def header(record: Record, name: str) -> str:
    return dict(record.headers)[name].decode()


# -- Segment: analytics-python ----------------------------------------------------------------


@dataclass
class Sent:
    """One HTTP request the Segment SDK made, as it went on the wire."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]  # the JSON document, inflated when it was gzip'd


@pytest.fixture
def segment_wire(monkeypatch: pytest.MonkeyPatch) -> list[Sent]:
    """Every request the Segment SDK sends, recorded on the way to the collector."""
    sent: list[Sent] = []
    session = segment_request._session
    post = session.post

    def recording_post(url: str, **kwargs: Any) -> requests.Response:
        data = kwargs["data"]
        headers = dict(kwargs["headers"])
        raw = gzip.decompress(data) if headers.get("Content-Encoding") == "gzip" else data
        sent.append(Sent(url, headers, json.loads(raw)))
        return post(url, **kwargs)

    monkeypatch.setattr(session, "post", recording_post)
    return sent


def assert_on_log_as_sent(bus: EmbeddedBus, events: Sequence[dict[str, Any]]) -> list[Record]:
    """Every event is on its type's topic, byte for byte the JSON the SDK sent (compact), once,
    in order, with its context in headers."""
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_topic.setdefault(f"events-{e['type']}", []).append(e)
    out = []
    for topic, sent in by_topic.items():
        stored = records(bus, topic)
        assert [orjson.loads(r.value) for r in stored] == sent
        assert [r.value for r in stored] == [orjson.dumps(e) for e in sent]  # key order too
        for r, e in zip(stored, sent, strict=True):
            assert r.key == (e.get("userId") or e["anonymousId"]).encode()
            assert header(r, context.TYPE) == e["type"]
            assert header(r, context.SOURCE) == "web"
            assert header(r, context.PROTOCOL) == "segment"
            assert header(r, context.CONTENT_TYPE) == "application/json"
            assert header(r, context.USER_AGENT) == f"analytics-python/{SEGMENT_VERSION}"
            assert uuid.UUID(header(r, context.EVENT_ID)).version == 7
        out += stored
    return out


def test_segment_sdk_every_call_lands_on_the_log_unmodified(
    server: RunningCollector, bus: EmbeddedBus, segment_wire: list[Sent]
) -> None:
    client = Client(KEY, host=server.url, sync_mode=True, timeout=TIMEOUT_S, max_retries=0)
    when = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=UTC)
    results = [
        client.identify(
            "user-1",
            {"email": "ada@example.com", "plan": "pro", "logins": 3, "vip": True},
            context={"ip": "10.1.2.3", "locale": "en-GB"},
        ),
        client.track(
            "user-1",
            "Order Completed",
            {
                "total": 19.99,
                "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-2", "qty": 1}],
                "coupon": None,
                "note": "ünïcödé ☃ \U0001f680",
                "big": 2**53 + 1,
            },
            timestamp=when,
            message_id="m-order-1",
            integrations={"All": False, "Mixpanel": True},
        ),
        client.page("user-1", "Docs", "Install", {"url": "https://example.com/docs", "n": 0}),
        client.screen(anonymous_id="anon-9", name="Home", properties={"variant": "b"}),
        client.group("user-1", "org-42", {"name": "Acme", "employees": 100}),
        client.alias("anon-9", "user-1"),
        client.track(user_id=12345, event="Numeric id", properties={"x": 1.5e-7}),
    ]

    assert all(ok for ok, _ in results)
    assert [s.url for s in segment_wire] == [server.url + "/v1/batch"] * len(results)
    assert {s.headers["Authorization"] for s in segment_wire} == {
        "Basic " + __import__("base64").b64encode(f"{KEY}:".encode()).decode()
    }
    sent = [e for s in segment_wire for e in s.body["batch"]]
    # What went on the wire is what the SDK says it enqueued.
    assert sent == [json.loads(json.dumps(msg)) for _, msg in results]
    stored = assert_on_log_as_sent(bus, sent)
    assert {orjson.loads(r.value)["messageId"] for r in stored} == {m["messageId"] for m in sent}
    order = next(orjson.loads(r.value) for r in records(bus, "events-track"))
    assert (
        order["messageId"] == "m-order-1" and order["timestamp"] == "2024-05-01T12:30:15.250+00:00"
    )
    assert order["properties"]["big"] == 2**53 + 1
    assert order["context"]["library"] == {"name": "analytics-python", "version": SEGMENT_VERSION}
    numeric = records(bus, "events-track")[1]
    assert orjson.loads(numeric.value)["userId"] == "12345" and numeric.key == b"12345"
    # the batch's sentAt and writeKey are the request's, not the events'
    assert all(
        "sentAt" not in e and "writeKey" not in e for e in map(orjson.loads, stored_values(bus))
    )


def stored_values(bus: EmbeddedBus) -> list[bytes]:
    return [r.value for r in all_records(bus)]


@pytest.mark.parametrize(
    "compressed",
    [False, True],
    ids=["plain", "gzip"],
)
def test_segment_sdk_batches_hundreds_of_events_in_background(
    server: RunningCollector, bus: EmbeddedBus, segment_wire: list[Sent], compressed: bool
) -> None:
    errors: list[tuple[Exception, list[Any]]] = []
    client = Client(
        KEY,
        host=server.url,
        gzip=compressed,
        upload_size=300,
        upload_interval=0.5,
        max_retries=0,
        timeout=TIMEOUT_S,
        on_error=lambda e, batch: errors.append((e, batch)),
    )
    try:
        for i in range(300):
            ok, _ = client.track(
                f"user-{i % 7}",
                "Batched",
                {"i": i, "tags": ["a", "b"][: i % 3], "pad": "x" * (i % 50)},
                message_id=f"batched-{i:04d}",
            )
            assert ok
        client.flush()  # returns once the queue is drained (sent, or failed into on_error)
    finally:
        client.join()

    assert errors == []
    assert all(
        s.headers.get("Content-Encoding") == ("gzip" if compressed else None) for s in segment_wire
    )
    sent = [e for s in segment_wire for e in s.body["batch"]]
    assert [e["messageId"] for e in sent] == [f"batched-{i:04d}" for i in range(300)]
    assert_on_log_as_sent(bus, sent)

    # The SDK's own transport, one batch of 400 in one request (compressed as configured).
    batch = [dict(e, messageId=f"direct-{i}") for i, e in enumerate(sent[:200] * 2)]
    segment_request.post(KEY, server.url, gzip=compressed, timeout=TIMEOUT_S, batch=batch)
    direct = [r for r in records(bus, "events-track") if b'"direct-' in r.value]
    assert [orjson.loads(r.value) for r in direct] == segment_wire[-1].body["batch"]
    assert len({header(r, context.REQUEST_ID) for r in direct}) == 1


def test_segment_sdk_with_a_wrong_key_is_refused_and_told_why(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    sync = Client("not-the-key", host=server.url, sync_mode=True, max_retries=0)
    with pytest.raises(APIError) as refused:
        sync.track("user-1", "Refused")
    assert refused.value.status == 401
    assert refused.value.code == "unauthorized"
    assert refused.value.message == "unknown write key"

    errors: list[tuple[Exception, list[Any]]] = []
    background = Client(
        "not-the-key",
        host=server.url,
        max_retries=0,
        upload_interval=0.1,
        on_error=lambda e, batch: errors.append((e, batch)),
    )
    try:
        background.track("user-1", "Refused too", message_id="refused-2")
        background.flush()
    finally:
        background.join()
    [(error, batch)] = errors
    assert isinstance(error, APIError) and error.status == 401
    assert [m["messageId"] for m in batch] == ["refused-2"]
    assert bus.topics() == []


# -- OpenTelemetry: the OTLP/HTTP log exporter ------------------------------------------------


class RecordingExporter(LogRecordExporter):
    """The OTLP exporter, with the result of every export it made kept."""

    def __init__(self, inner: OTLPLogExporter) -> None:
        self.inner = inner
        self.results: list[LogRecordExportResult] = []

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        result = self.inner.export(batch)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def otlp_exporter(server: RunningCollector, key: str, **kwargs: Any) -> RecordingExporter:
    return RecordingExporter(
        OTLPLogExporter(
            endpoint=server.url + "/v1/logs",
            headers={"x-write-key": key},
            timeout=TIMEOUT_S,
            **kwargs,
        )
    )


@pytest.mark.parametrize(
    "compression",
    [
        Compression.NoCompression,
        Compression.Gzip,
    ],
    ids=["plain", "gzip"],
)
def test_otlp_log_exporter_records_carry_resource_and_scope(
    server: RunningCollector, bus: EmbeddedBus, compression: Compression
) -> None:
    exporter = otlp_exporter(server, KEY, compression=compression)
    resource = Resource.create({"service.name": "checkout", "deployment.environment": "test"})
    provider = LoggerProvider(resource=resource)
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    try:
        api = provider.get_logger("shop.api", "2.1.0", attributes={"team": "payments"})
        worker = provider.get_logger("shop.worker", schema_url="https://opentelemetry.io/s/1.0")
        trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
        span = NonRecordingSpan(SpanContext(trace_id, span_id, False, TraceFlags(1)))
        api.emit(
            timestamp=1_714_566_615_000_000_001,
            severity_number=SeverityNumber.ERROR,
            severity_text="ERROR",
            body="payment declined",
            attributes={"order": "o-1", "amount": 19.99, "retries": 2, "final": False},
            context=set_span_in_context(span),
            event_name="payment.declined",
        )
        api.emit(
            severity_number=SeverityNumber.INFO,
            body={"structured": {"ok": True, "codes": [1, 2]}},
            attributes={"tags": ["a", "b"]},
        )
        worker.emit(severity_number=SeverityNumber.DEBUG, body="tick")
        assert provider.force_flush(TIMEOUT_S * 1000)
    finally:
        provider.shutdown()

    assert exporter.results and set(exporter.results) == {LogRecordExportResult.SUCCESS}
    stored = records(bus, "events-log")
    values = [orjson.loads(r.value) for r in stored]
    assert [v["body"] for v in values] == [
        "payment declined",
        {"structured": {"ok": True, "codes": [1, 2]}},
        "tick",
    ]
    for v in values:
        assert v["resource"]["attributes"] == dict(resource.attributes)
    assert [v["scope"]["name"] for v in values] == ["shop.api", "shop.api", "shop.worker"]
    assert values[0]["scope"] == {
        "name": "shop.api",
        "version": "2.1.0",
        "attributes": {"team": "payments"},
        "dropped_attributes_count": 0,
        "schema_url": "",
    }
    assert values[2]["scope"]["schema_url"] == "https://opentelemetry.io/s/1.0"
    first = values[0]
    assert first["time_unix_nano"] == 1_714_566_615_000_000_001
    assert (first["severity_number"], first["severity_text"]) == (17, "ERROR")
    assert first["attributes"] == {"order": "o-1", "amount": 19.99, "retries": 2, "final": False}
    assert first["event_name"] == "payment.declined"
    assert (first["trace_id"], first["span_id"]) == (f"{trace_id:032x}", f"{span_id:016x}")
    assert first["flags"] == 1
    assert stored[0].key == f"{trace_id:032x}".encode()
    assert values[1]["attributes"] == {"tags": ["a", "b"]}
    for r in stored:
        assert header(r, context.SOURCE) == "web" and header(r, context.PROTOCOL) == "otlp"
        assert header(r, context.USER_AGENT).startswith("OTel-OTLP-Exporter-Python/")


def test_otlp_log_exporter_with_a_wrong_key_reports_failure(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    exporter = otlp_exporter(server, "not-the-key")
    provider = LoggerProvider(resource=Resource.create({"service.name": "intruder"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    try:
        provider.get_logger("x").emit(body="let me in")
        provider.force_flush(TIMEOUT_S * 1000)
    finally:
        provider.shutdown()
    # The exporter logs the 401 (its own wording, not asserted); what it reports is a failure.
    assert exporter.results == [LogRecordExportResult.FAILURE]
    assert bus.topics() == []


# -- Jitsu: plain HTTP clients ----------------------------------------------------------------


def urllib_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_jitsu_typed_api_with_the_key_in_a_header(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    event = {
        "type": "track",
        "event": "Signup",
        "messageId": "j-1",
        "userId": "u-7",
        "anonymousId": "a-7",
        "properties": {"plan": "team", "seats": 5},
        "context": {"page": {"url": "https://example.com/?q=1"}, "locale": "de-DE"},
        "timestamp": "2024-05-01T12:00:00.000Z",
    }
    body = json.dumps(event).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "jitsu-test/1"}
    ok = urllib_post(server.url + "/api/s/track", body, {**headers, "X-Write-Key": KEY})
    wrong = urllib_post(server.url + "/api/s/track", body, {**headers, "X-Write-Key": "nope"})
    missing = urllib_post(server.url + "/api/s/track", body, headers)

    assert ok == (200, {"ok": True})
    assert (
        wrong[0] == 401 and wrong[1]["ok"] is False and "unknown write key" in wrong[1]["message"]
    )
    assert missing[0] == 401 and "write key is required" in missing[1]["message"]
    [stored] = records(bus, "events-track")
    assert stored.value == orjson.dumps(event)
    assert stored.key == b"u-7"
    assert header(stored, context.PROTOCOL) == "jitsu"
    assert header(stored, context.SOURCE) == "web"
    assert header(stored, context.USER_AGENT) == "jitsu-test/1"


def test_jitsu_classic_api_with_the_token_in_the_query(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    events = [
        {"event_type": "pageview", "eventn_ctx": {"event_id": "c-1"}, "user": {"id": "u-1"}},
        {"event_type": "pageview", "api_key": KEY, "user": {"anonymous_id": "anon-2"}, "n": 2},
    ]
    with requests.Session() as http:
        ok = http.post(
            server.url + "/api/v1/event", params={"token": KEY}, json=events, timeout=TIMEOUT_S
        )
        wrong = http.post(
            server.url + "/api/v1/event",
            params={"token": "nope"},
            json=events[0],
            timeout=TIMEOUT_S,
        )
    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    assert wrong.status_code == 401 and "unknown write key" in wrong.json()["message"]
    stored = records(bus, "events-pageview")
    # As documented: the classic SDK's api_key is a credential, taken out of the event.
    assert [orjson.loads(r.value) for r in stored] == [
        events[0],
        {k: v for k, v in events[1].items() if k != "api_key"},
    ]
    assert [r.key for r in stored] == [b"u-1", b"anon-2"]
    assert {header(r, context.PROTOCOL) for r in stored} == {"jitsu"}


# -- Raccoon over the websockets library ------------------------------------------------------


def test_raccoon_over_the_websockets_library(bus: EmbeddedBus) -> None:
    """Another WebSocket implementation (with permessage-deflate, which it offers by default):
    pipelined binary requests, JSON text requests, a client ping, and 1001 on shutdown."""

    async def scenario(server: RunningCollector) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with ws_connect(
            server.ws_url,
            additional_headers={"X-User-ID": "websockets-lib"},
            user_agent_header="raccoon-ws-test/1.0",
            open_timeout=TIMEOUT_S,
        ) as ws:
            out["extensions"] = ws.response.headers.get("Sec-WebSocket-Extensions", "")
            for i in range(40):  # pipelined: all sent before any answer is read
                events = [("lib", b"lib-%d-%d\x00\xff" % (i, k)) for k in range(3)]
                await ws.send(raccoon_request(f"lib-{i}", events))
            answers = [
                raccoon_response(await asyncio.wait_for(ws.recv(), TIMEOUT_S)) for _ in range(40)
            ]
            out["binary"] = {(a.data["req_guid"], a.status) for a in answers}
            for i in range(5):
                frame = {
                    "req_guid": f"text-{i}",
                    "events": [
                        {
                            "type": "lib-json",
                            "event_bytes": base64.b64encode(b"text-%d" % i).decode(),
                        }
                    ],
                }
                await ws.send(json.dumps(frame))
                out.setdefault("text", []).append(
                    json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
                )
            out["pong_latency"] = await asyncio.wait_for(await ws.ping(b"still there?"), TIMEOUT_S)
            stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
            await asyncio.wait_for(ws.wait_closed(), TIMEOUT_S)
            await stopping
            out["close"] = (ws.close_code, ws.close_reason)
        return out

    with running_collector(bus, CONFIG) as server:
        out = asyncio.run(scenario(server))

    assert "permessage-deflate" in out["extensions"]
    assert out["binary"] == {(f"lib-{i}", raccoon.Status.SUCCESS) for i in range(40)}
    assert [(t["status"], t["data"]["req_guid"]) for t in out["text"]] == [
        (1, f"text-{i}") for i in range(5)
    ]
    assert out["pong_latency"] >= 0
    assert out["close"] == (1001, "server shutting down")
    stored = records(bus, "clickstream-lib-log")
    assert sorted(r.value for r in stored) == sorted(
        b"lib-%d-%d\x00\xff" % (i, k) for i in range(40) for k in range(3)
    )
    for r in stored:  # each request's events stay together, in order, under its req_guid
        i, _k = map(int, r.value[4:].split(b"\x00")[0].split(b"-"))
        assert header(r, context.REQUEST_ID) == f"lib-{i}"
        assert header(r, context.USER_AGENT) == "raccoon-ws-test/1.0"
        assert header(r, context.PROTOCOL) == "raccoon-ws"
    assert [r.value for r in records(bus, "clickstream-lib-json-log")] == [
        b"text-%d" % i for i in range(5)
    ]
