"""The collector over real sockets: Raccoon WebSocket (binary and JSON), REST, gRPC, limits,
keepalive, backpressure, metrics and graceful shutdown, on a real embedded log."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import grpc

from headwater.bus import context
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.collector.config import CollectorConfig, RaccoonConfig
from headwater.collector.protocols import raccoon
from headwater.testing.collector import RunningCollector, running_collector

USER = {"X-User-ID": "user-1"}


def request_bytes(req_guid: str, events: list[tuple[str, bytes]]) -> bytes:
    req: Any = raccoon.SendEventRequest(req_guid=req_guid)
    for t, b in events:
        req.events.add(type=t, event_bytes=b)
    return req.SerializeToString()


def parse_response(data: bytes) -> Any:
    resp: Any = raccoon.SendEventResponse()
    resp.ParseFromString(data)
    return resp


def values(bus: EmbeddedBus, topic: str) -> list[bytes]:
    return [r.value for r in bus.read(topic, 0, 0, max_records=10_000)]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_websocket_binary_requests_are_stored_untouched_and_acked(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    async def scenario() -> list[Any]:
        async with aiohttp.ClientSession() as s, s.ws_connect(server.ws_url, headers=USER) as ws:
            out = []
            for i in range(3):
                events = [("viewed", b"\x00\xffpayload-%d" % i), ("clicked", b"c%d" % i)]
                await ws.send_bytes(request_bytes(f"req-{i}", events))
                out.append(parse_response(await ws.receive_bytes(timeout=10)))
            return out

    responses = run(scenario())
    assert [r.status for r in responses] == [raccoon.Status.SUCCESS] * 3
    assert [r.data["req_guid"] for r in responses] == ["req-0", "req-1", "req-2"]
    assert values(bus, "clickstream-viewed-log") == [b"\x00\xffpayload-%d" % i for i in range(3)]
    assert values(bus, "clickstream-clicked-log") == [b"c0", b"c1", b"c2"]
    record = bus.read("clickstream-viewed-log", 0, 0)[0]
    headers = dict(record.headers)
    assert headers[context.TYPE] == b"viewed"
    assert headers[context.REQUEST_ID] == b"req-0"
    assert headers[context.PROTOCOL] == b"raccoon-ws"
    assert headers[context.CLIENT_IP] == b"127.0.0.1"
    assert headers[context.SOURCE] == b"raccoon"


def test_websocket_json_frames_and_repeated_req_guid(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    frame = json.dumps({"reqGuid": "j-1", "events": [{"eventBytes": "aGVsbG8=", "type": "page"}]})

    async def scenario() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.ws_connect(server.ws_url, headers=USER) as ws:
            out = []
            for _ in range(2):  # the same request twice: published once, acked twice
                await ws.send_str(frame)
                out.append(json.loads(await ws.receive_str(timeout=10)))
            return out

    first, second = run(scenario())
    assert first["status"] == 1 and first["data"]["req_guid"] == "j-1"
    assert second["status"] == 1
    assert values(bus, "clickstream-page-log") == [b"hello"]


def test_bad_request_gets_a_reason_and_the_connection_stays_usable(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        async with aiohttp.ClientSession() as s, s.ws_connect(server.ws_url, headers=USER) as ws:
            await ws.send_bytes(b"\x1a\x05\x0a\x03ab")  # a truncated event
            bad = parse_response(await ws.receive_bytes(timeout=10))
            await ws.send_bytes(request_bytes("empty", []))
            empty = parse_response(await ws.receive_bytes(timeout=10))
            await ws.send_bytes(request_bytes("ok", [("a", b"1")]))
            good = parse_response(await ws.receive_bytes(timeout=10))
            return bad, empty, good

    bad, empty, good = run(scenario())
    assert bad.status == raccoon.Status.ERROR and bad.code == raccoon.Code.BAD_REQUEST
    assert bad.reason.startswith("malformed protobuf")
    assert empty.code == raccoon.Code.BAD_REQUEST and "no events" in empty.reason
    assert empty.data["req_guid"] == "empty"
    assert good.status == raccoon.Status.SUCCESS
    assert values(bus, "clickstream-a-log") == [b"1"]


def test_connection_limits_answer_with_raccoon_codes(bus: EmbeddedBus) -> None:
    config = CollectorConfig(raccoon=RaccoonConfig(max_connections=2))

    async def scenario(server: RunningCollector) -> tuple[Any, Any, Any]:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.ws_url) as anonymous:
                no_id = parse_response(await anonymous.receive_bytes(timeout=10))
            first = await s.ws_connect(server.ws_url, headers=USER)
            async with s.ws_connect(server.ws_url, headers=USER) as again:
                same_user = parse_response(await again.receive_bytes(timeout=10))
                await again.receive(timeout=10)
                assert again.closed
            second = await s.ws_connect(server.ws_url, headers={"X-User-ID": "user-2"})
            async with s.ws_connect(server.ws_url, headers={"X-User-ID": "user-3"}) as third:
                full = parse_response(await third.receive_bytes(timeout=10))
            await first.close()
            await second.close()
            return no_id, same_user, full

    with running_collector(bus, config) as server:
        no_id, same_user, full = run(scenario(server))
    assert no_id.code == raccoon.Code.BAD_REQUEST and "X-User-ID" in no_id.reason
    assert same_user.code == raccoon.Code.MAX_USER_LIMIT_REACHED
    assert full.code == raccoon.Code.MAX_CONNECTION_LIMIT_REACHED


def test_rest_in_both_encodings_and_wrong_content_type(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        url = server.url + "/api/v1/events"
        out = []
        async with aiohttp.ClientSession() as s:
            body = request_bytes("r-1", [("a", b"proto")])
            for data, ctype in [
                (body, "application/proto"),
                (
                    json.dumps(
                        {"req_guid": "r-2", "events": [{"event_bytes": "SlNPTg==", "type": "a"}]}
                    ),
                    "application/json",
                ),
                (body, "text/plain"),
            ]:
                async with s.post(url, data=data, headers={"Content-Type": ctype}) as r:
                    out.append((r.status, await r.read()))
        return out

    (s1, proto), (s2, as_json), (s3, wrong) = run(scenario())
    assert s1 == 200 and parse_response(proto).data["req_guid"] == "r-1"
    assert s2 == 200 and json.loads(as_json)["data"]["req_guid"] == "r-2"
    assert s3 == 415 and b"text/plain" in wrong
    assert values(bus, "clickstream-a-log") == [b"proto", b"JSON"]


def test_grpc_send_event(server: RunningCollector, bus: EmbeddedBus) -> None:
    async def scenario() -> Any:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.unary_unary(
                f"/{raccoon.SERVICE_NAME}/SendEvent",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=raccoon.SendEventResponse.FromString,
            )
            req: Any = raccoon.SendEventRequest(req_guid="g-1")
            req.events.add(type="grpc", event_bytes=b"over grpc")
            return await call(req, timeout=10)

    response = run(scenario())
    assert response.status == raccoon.Status.SUCCESS and response.data["req_guid"] == "g-1"
    record = bus.read("clickstream-grpc-log", 0, 0)[0]
    assert record.value == b"over grpc"
    assert dict(record.headers)[context.PROTOCOL] == b"raccoon-grpc"


def test_oversize_frame_closes_that_connection_only(bus: EmbeddedBus) -> None:
    config = CollectorConfig().model_copy(
        update={"limits": CollectorConfig().limits.model_copy(update={"max_frame_bytes": 1000})}
    )

    async def scenario(server: RunningCollector) -> tuple[int | None, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(server.ws_url, headers={"X-User-ID": "other"}) as other,
        ):
            async with s.ws_connect(server.ws_url, headers=USER) as big:
                await big.send_bytes(request_bytes("big", [("a", b"x" * 5000)]))
                msg = await big.receive(timeout=10)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                code = big.close_code
            await other.send_bytes(request_bytes("fine", [("a", b"1")]))
            return code, parse_response(await other.receive_bytes(timeout=10))

    with running_collector(bus, config) as server:
        code, fine = run(scenario(server))
    assert code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    assert fine.status == raccoon.Status.SUCCESS


def test_keepalive_pings_answers_pings_and_drops_silent_clients(bus: EmbeddedBus) -> None:
    config = CollectorConfig(raccoon=RaccoonConfig(ping_interval_s=0.05, pong_wait_s=0.3))

    async def scenario(server: RunningCollector) -> tuple[bool, bytes, int | None]:
        # autoping off: this client never answers the server's pings
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(server.ws_url, headers=USER, autoping=False) as silent,
        ):
            await silent.ping(b"are you there")
            got_ping, pong = False, b""
            deadline = time.monotonic() + 10
            while not silent.closed and time.monotonic() < deadline:
                msg = await silent.receive(timeout=10)
                if msg.type is aiohttp.WSMsgType.PING:
                    got_ping = True
                elif msg.type is aiohttp.WSMsgType.PONG:
                    pong = msg.data
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    break
            return got_ping, pong, silent.close_code

    with running_collector(bus, config) as server:
        got_ping, pong, code = run(scenario(server))
    assert got_ping and pong == b"are you there"
    assert code == aiohttp.WSCloseCode.GOING_AWAY


def test_backpressure_refuses_with_retry_after_and_stores_nothing(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    server.collector.admission.refusal = "the disk budget is exceeded (test)"

    async def scenario() -> tuple[int, str | None, Any]:
        async with aiohttp.ClientSession() as s:
            body = request_bytes("bp", [("a", b"1")])
            async with s.post(
                server.url + "/api/v1/events",
                data=body,
                headers={"Content-Type": "application/proto"},
            ) as r:
                status, retry = r.status, r.headers.get("Retry-After")
            async with s.ws_connect(server.ws_url, headers=USER) as ws:
                await ws.send_bytes(body)
                return status, retry, parse_response(await ws.receive_bytes(timeout=10))

    status, retry, ws_response = run(scenario())
    assert status == 503 and retry == "1"
    assert ws_response.code == raccoon.Code.INTERNAL_ERROR
    assert "disk budget" in ws_response.reason and ws_response.data["retry_after"] == "1"
    assert bus.topics() == []


def test_health_readiness_and_metrics(server: RunningCollector) -> None:
    async def scenario() -> dict[str, tuple[int, str]]:
        out = {}
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.ws_url, headers=USER) as ws:
                await ws.send_bytes(request_bytes("m", [("metered", b"12345")]))
                await ws.receive_bytes(timeout=10)
                await ws.send_bytes(b"\xff")
                await ws.receive_bytes(timeout=10)
            for path in ("/healthz", "/readyz", "/metrics", "/nope"):
                async with s.get(server.url + path) as r:
                    out[path] = (r.status, await r.text())
        return out

    out = run(scenario())
    assert out["/healthz"] == (200, "ok\n") and out["/readyz"][0] == 200
    assert out["/nope"][0] == 404
    metrics = out["/metrics"][1]
    received = 'headwater_collector_events_received_total{protocol="raccoon-ws",type="metered"}'
    assert f"{received} 1.0" in metrics
    assert 'headwater_collector_bytes_published_total{type="metered"} 5.0' in metrics
    assert 'headwater_collector_rejects_total{reason="malformed"} 1.0' in metrics
    assert "headwater_collector_ack_latency_seconds_bucket" in metrics


def test_graceful_shutdown_finishes_in_flight_and_closes_with_1001(bus: EmbeddedBus) -> None:
    async def scenario(server: RunningCollector) -> tuple[list[Any], int | None]:
        async with aiohttp.ClientSession() as s, s.ws_connect(server.ws_url, headers=USER) as ws:
            for i in range(20):
                await ws.send_bytes(request_bytes(f"s-{i}", [("s", b"%d" % i)]))
            stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
            responses = []
            while True:
                msg = await ws.receive(timeout=30)
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    break
                responses.append(parse_response(msg.data))
            await stopping
            return responses, ws.close_code

    with running_collector(bus) as server:
        responses, code = run(scenario(server))
    acked = {r.data["req_guid"] for r in responses if r.status == raccoon.Status.SUCCESS}
    stored = {b"s-%d" % int(v) for v in values(bus, "clickstream-s-log")}
    assert code == aiohttp.WSCloseCode.GOING_AWAY
    assert {a.encode() for a in acked} <= stored, "every acked request is on the log"
    assert len(responses) == 20, "every in-flight request was answered before the close"


def test_json_apis_preflight_keys_and_empty_exports(bus: EmbeddedBus) -> None:
    from headwater.collector.auth import hash_key
    from headwater.collector.config import SourceConfig

    config = CollectorConfig(sources=[SourceConfig(id="web", write_keys=[hash_key("K1")])])

    async def scenario(server: RunningCollector) -> dict[str, Any]:
        out: dict[str, Any] = {}
        origin = {"Origin": "https://shop.example"}
        async with aiohttp.ClientSession() as s:
            async with s.options(server.url + "/v1/batch", headers=origin) as r:
                out["preflight"] = (r.status, dict(r.headers))
            event = {"type": "track", "event": "Bought", "userId": "u1", "writeKey": "K2"}
            async with s.post(
                server.url + "/v1/track", json=event, headers={**origin, "X-Write-Key": "K1"}
            ) as r:
                out["two_keys"] = (
                    r.status,
                    await r.json(),
                    r.headers.get("access-control-allow-origin"),
                )
            async with s.post(
                server.url + "/api/s/s2s/track",
                json={"userId": "u2", "event": "x"},
                headers={"X-Write-Key": "K1"},
            ) as r:
                out["s2s"] = r.status
            async with s.post(server.url + "/v1/logs", json={}, headers={"X-Write-Key": "K1"}) as r:
                out["empty_otlp"] = r.status
        return out

    with running_collector(bus, config) as server:
        out = run(scenario(server))
    status, headers = out["preflight"]
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://shop.example"
    assert "X-Write-Key" in headers["Access-Control-Allow-Headers"]
    status, body, allow_origin = out["two_keys"]
    assert status == 401 and "two different write keys" in json.dumps(body)
    assert allow_origin == "https://shop.example"
    assert out["s2s"] == 200 and out["empty_otlp"] == 200
    assert [t.name for t in bus.topics()] == ["events-track"]


def test_statsd_export(bus: EmbeddedBus) -> None:
    import socket

    from headwater.collector.config import StatsdConfig

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        udp.settimeout(10)
        port = udp.getsockname()[1]
        config = CollectorConfig(statsd=StatsdConfig(port=port, interval_s=0.05, prefix="hw"))

        async def send(server: RunningCollector) -> None:
            async with (
                aiohttp.ClientSession() as s,
                s.ws_connect(server.ws_url, headers=USER) as ws,
            ):
                await ws.send_bytes(request_bytes("sd", [("stat", b"123")]))
                await ws.receive_bytes(timeout=10)

        with running_collector(bus, config) as server:
            run(send(server))
            lines: list[str] = []
            deadline = time.monotonic() + 10
            while not any("events_received_total" in line for line in lines):
                assert time.monotonic() < deadline, lines
                lines.append(udp.recv(4096).decode())
    assert "hw.headwater_collector_events_received_total.raccoon-ws.stat:1|c" in lines
