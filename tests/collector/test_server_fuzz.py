"""The running collector under a storm of malformed input over real sockets, while good clients
keep sending: every good request is acked with success, the log holds exactly the good events,
and the server keeps serving.

The decoders get their 100k+ inputs each in their own fuzz tests; this one is about the server:
mutated protobuf and JSON frames over several WebSockets, protocol-level WebSocket junk (reserved
bits, bad opcodes, invalid UTF-8, oversize frames), malformed REST bodies with wrong or missing
content types, broken gzip, decompression bombs, oversize bodies, junk on the Segment, Jitsu and
OTLP routes, unknown write keys, raw HTTP that the parser must refuse, random gRPC messages, and
slow connections that never finish a request. A malformed input is only sent when the
collector's own decoder refuses it, so "nothing of the malformed ones is stored" is exact.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import gzip
import json
import random
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.collector.auth import hash_key
from headwater.collector.config import (
    CollectorConfig,
    LimitsConfig,
    RaccoonConfig,
    SourceConfig,
)
from headwater.collector.errors import Rejected
from headwater.collector.protocols import jitsu, otlp, raccoon, segment
from headwater.collector.protocols.body import decode_body
from headwater.testing.clients import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_TEXT,
    RawWebSocket,
    close_writer,
    encode_frame,
    http_exchange,
    raccoon_request,
    raccoon_response,
)
from headwater.testing.collector import RunningCollector, running_collector

KEY = "fuzz-write-key"
TARGET_MALFORMED = 15_000  # stop the storm here ...
MIN_MALFORMED = 10_000  # ... and require at least this many within the deadline
STORM_DEADLINE_S = 30.0
# A known collector bug (see test_content_codings_are_undone_by_the_collector_alone): aiohttp
# inflates request bodies before the collector does, so a corrupt gzip body gets a 500 and an
# unsupported coding aiohttp's 400. Tolerated (and counted) in the storm; drop this once that
# test passes.
CODING_BUG = {400, 500}
GRPC_SHARE = 1_500  # gRPC calls are cheap to make: keep them from crowding out the rest
MAX_BYTES = 64 * 1024
LIMITS = LimitsConfig(
    max_body_bytes=MAX_BYTES,
    max_frame_bytes=MAX_BYTES,
    max_batch_events=100,
    request_timeout_s=2.0,
)
CONFIG = CollectorConfig(
    sources=[SourceConfig(id="web", write_keys=[hash_key(KEY)])],
    limits=LIMITS,
    raccoon=RaccoonConfig(ping_interval_s=1.0, pong_wait_s=3.0),
)
GOOD_TOPICS = {"clickstream-good-log", "events-track"}
SEED = random.randrange(1 << 32)


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    with EmbeddedBus(tmp_path / "log", EmbeddedBusConfig(default_partitions=2)) as b:
        yield b


# -- mutation ---------------------------------------------------------------------------------

INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff" * 10, b"\x80" * 10 + b"\x01", b"\n"]


def mutate_bytes(rng: random.Random, data: bytes, rounds: int = 0) -> bytes:
    """``data`` with 1-4 random byte-level edits."""
    buf = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        op = rng.randrange(9)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip a bit
            i = min(pos, len(buf) - 1)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # set a byte
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 2:  # insert random bytes
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:  # delete a range
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == 4 and buf:  # duplicate a range
            end = min(len(buf), pos + rng.randint(1, 32))
            buf[pos:pos] = buf[pos:end]
        elif op == 5:  # truncate
            del buf[pos:]
        elif op == 6:  # an interesting value
            buf[pos:pos] = rng.choice(INTERESTING)
        elif op == 7:  # append junk
            buf += rng.randbytes(rng.randint(1, 32))
        else:  # swap two ranges
            a, b = sorted((rng.randrange(len(buf) + 1), rng.randrange(len(buf) + 1)))
            buf[:] = buf[:a] + buf[b:] + buf[a:b]
    return bytes(buf)


def random_json_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 2**63, -(2**64), 1e308, 0.5])
    if pick == 3:
        return rng.choice(["", "x", "\u0000", "é☃\U0001f600", "a" * 300, "\\u00"])
    if pick == 4:
        return rng.choice(["track", "identify", "page", "log", "nope", "%s", "{type}"])
    if pick == 5:
        return base64.b64encode(rng.randbytes(rng.randint(0, 12))).decode()
    if pick == 6:
        return rng.choice([[], {}])
    if pick in (7, 8):
        return [random_json_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return {
        rng.choice(["a", "type", "events", "batch", "userId"]): random_json_value(rng, depth + 1)
    }


def mutate_json_doc(rng: random.Random, doc: Any) -> Any:
    """A copy of ``doc`` with one structural edit somewhere in it."""
    doc = json.loads(json.dumps(doc))
    holders: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                holders.append((node, k))
                walk(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                holders.append((node, i))
                walk(v)

    walk(doc)
    if not holders:
        return random_json_value(rng)
    holder, key = rng.choice(holders)
    op = rng.randrange(5)
    if op == 0:
        holder[key] = random_json_value(rng)
    elif op == 1:
        del holder[key]
    elif op == 2 and isinstance(holder, dict):
        holder[rng.choice(["unknown", "Type", "event_bytes", "writeKey", ""])] = random_json_value(
            rng
        )
    elif op == 3:
        nested: Any = holder[key]
        for _ in range(rng.choice([2, 50, 300, 600])):  # json.dumps recurses: < 1000
            nested = [nested]
        holder[key] = nested
    else:
        holder[key] = str(holder[key])
    return doc


def mutate_json(rng: random.Random, doc: Any) -> bytes:
    """A JSON seed broken structurally, textually or both."""
    how = rng.randrange(3)
    if how == 0:
        return json.dumps(mutate_json_doc(rng, doc)).encode()
    text = json.dumps(mutate_json_doc(rng, doc) if how == 2 else doc).encode()
    return mutate_bytes(rng, text)


# -- seeds: valid requests the mutations start from ------------------------------------------


def raccoon_seeds() -> list[bytes]:
    req: Any = raccoon.SendEventRequest(req_guid="seed-3")
    req.sent_time.seconds = 1_700_000_000
    req.events.add(type="fuzz", event_bytes=b"\x08\x01\x12\x03abc")
    return [
        raccoon_request("seed-1", [("fuzz", b"payload")]),
        raccoon_request("seed-2", [("a", b""), ("b", b"\x00" * 20), ("c", b"x" * 200)]),
        req.SerializeToString(),
    ]


RACCOON_JSON_SEEDS: list[Any] = [
    {"req_guid": "j-1", "events": [{"event_bytes": "aGVsbG8=", "type": "fuzz"}]},
    {
        "reqGuid": "j-2",
        "sentTime": {"seconds": 1700000000, "nanos": 5},
        "events": [{"eventBytes": "AAEC", "type": "a"}, {"eventBytes": "", "type": "b"}],
    },
    {"req_guid": "j-3", "sent_time": "2024-01-01T00:00:00Z", "events": [{"type": "x"}]},
]

SEGMENT_SEEDS: list[tuple[str, Any]] = [
    (
        "batch",
        {
            "batch": [
                {"type": "track", "event": "Bought", "userId": "u1", "properties": {"n": 1}},
                {"type": "identify", "anonymousId": "a1", "traits": {"x": "y"}},
            ],
            "sentAt": "2024-01-01T00:00:00Z",
            "context": {"ip": "1.2.3.4"},
        },
    ),
    ("track", {"event": "Viewed", "userId": "u2", "properties": {"p": [1, 2]}}),
    ("alias", {"previousId": "old", "userId": "new"}),
    ("group", {"groupId": "g", "anonymousId": "a"}),
]

JITSU_TYPED_SEEDS: list[tuple[str, Any]] = [
    ("track", {"event": "Clicked", "userId": "u1", "properties": {"k": "v"}}),
    ("page", {"anonymousId": "a", "properties": {"url": "https://x"}}),
    ("event", {"type": "custom", "userId": "u"}),
]

JITSU_CLASSIC_SEEDS: list[Any] = [
    {"event_type": "pageview", "user": {"id": "u"}},
    [{"event_type": "a", "user": {"anonymous_id": "x"}}, {"event_type": "b"}],
    {"template": {"src": "api"}, "events": [{"event_type": "c"}]},
]


def otlp_seed() -> bytes:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.add(key="service.name").value.string_value = "svc"
    sl = rl.scope_logs.add()
    sl.scope.name = "scope"
    rec = sl.log_records.add()
    rec.time_unix_nano = 1
    rec.severity_number = 9
    rec.body.string_value = "hello"
    rec.attributes.add(key="n").value.int_value = 3
    rec.trace_id = b"\x01" * 16
    rec.span_id = b"\x02" * 8
    return req.SerializeToString()


OTLP_JSON_SEED: Any = {
    "resourceLogs": [
        {
            "resource": {"attributes": [{"key": "a", "value": {"stringValue": "b"}}]},
            "scopeLogs": [
                {
                    "scope": {"name": "s"},
                    "logRecords": [
                        {
                            "timeUnixNano": "1",
                            "body": {"stringValue": "x"},
                            "traceId": "0102030405060708090a0b0c0d0e0f10",
                        }
                    ],
                }
            ],
        }
    ]
}


# -- oracles: the collector's own decoders decide what is malformed ---------------------------


def refused(decode: Callable[[], Any]) -> bool:
    try:
        decode()
    except Rejected:
        return True
    return False


def malformed_raccoon(rng: random.Random, seeds: list[bytes]) -> bytes:
    while True:
        data = mutate_bytes(rng, rng.choice(seeds))
        if refused(lambda d=data: raccoon.decode_request(d, LIMITS)):  # type: ignore[misc]
            return data


def malformed_raccoon_json(rng: random.Random) -> str:
    while True:
        text = mutate_json(rng, rng.choice(RACCOON_JSON_SEEDS)).decode("utf-8", "replace")
        if refused(lambda t=text: raccoon.decode_request_json(t, LIMITS)):  # type: ignore[misc]
            return text


def json_api_refuses(path: str, body: bytes, content_type: str, encoding: str | None) -> bool:
    def decode() -> None:
        raw = decode_body(body, encoding, LIMITS.max_body_bytes)
        if path.startswith("/v1/logs"):
            otlp.decode_otlp_logs(raw, content_type, LIMITS)
        elif path.startswith("/v1/"):
            segment.decode_segment(path[4:], raw, LIMITS)
        elif path.startswith("/api/s/"):
            jitsu.decode_jitsu_typed(path[7:], raw, LIMITS)
        else:
            jitsu.decode_jitsu_classic(raw, LIMITS)

    return refused(decode)


# -- bookkeeping ------------------------------------------------------------------------------


@dataclass
class Storm:
    """Counts and findings shared by every client of the test."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    malformed: collections.Counter[str] = field(default_factory=collections.Counter)
    unexpected: list[str] = field(default_factory=list)
    good_sent: list[tuple[str, bytes]] = field(default_factory=list)  # (topic, value)
    good_acks: int = 0
    known_bug: int = 0
    good_latency_max: float = 0.0

    def count(self, kind: str) -> None:
        self.malformed[kind] += 1
        if self.malformed.total() >= TARGET_MALFORMED:
            self.stop.set()

    def wrong(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)


# -- the good clients -------------------------------------------------------------------------


async def good_websocket(server: RunningCollector, storm: Storm) -> None:
    """Valid Raccoon requests one after another on one WebSocket: each must be acked."""
    n = 0
    async with (
        aiohttp.ClientSession() as s,
        s.ws_connect(server.ws_url, headers={"X-User-ID": "good"}) as ws,
    ):
        while not storm.stop.is_set():
            n += 1
            events = [("good", b"good-ws-%d-%d" % (n, k)) for k in range(1 + n % 3)]
            started = time.monotonic()
            await ws.send_bytes(raccoon_request(f"good-{n}", events))
            response = raccoon_response(await ws.receive_bytes(timeout=10))
            storm.good_latency_max = max(storm.good_latency_max, time.monotonic() - started)
            assert response.status == raccoon.Status.SUCCESS, response
            assert response.data["req_guid"] == f"good-{n}"
            storm.good_sent += [("clickstream-good-log", b) for _, b in events]
            storm.good_acks += 1


async def good_segment(server: RunningCollector, storm: Storm) -> None:
    """Valid Segment batches over HTTP keep-alive: each must get 200 {"success": true}."""
    n = 0
    auth = {"Authorization": aiohttp.encode_basic_auth(KEY)}
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        while not storm.stop.is_set():
            n += 1
            batch = [
                {"type": "track", "event": "Good", "userId": f"u{n}", "messageId": f"g-{n}-{k}"}
                for k in range(2)
            ]
            started = time.monotonic()
            async with s.post(server.url + "/v1/batch", json={"batch": batch}, headers=auth) as r:
                body = await r.read()
                assert (r.status, body) == (200, segment.SUCCESS_BODY)
            storm.good_latency_max = max(storm.good_latency_max, time.monotonic() - started)
            storm.good_sent += [("events-track", orjson.dumps(e)) for e in batch]
            storm.good_acks += 1


# -- malformed WebSocket traffic --------------------------------------------------------------


def ws_junk_frame(rng: random.Random) -> bytes:
    """A frame that breaks the WebSocket protocol itself: the server must close."""
    pick = rng.randrange(9)
    payload = rng.randbytes(rng.randint(0, 40))
    if pick == 0:
        return encode_frame(OP_TEXT, b"\xff\xfe" + payload)  # invalid UTF-8
    if pick == 1:
        return encode_frame(OP_BINARY, payload, rsv=rng.randint(1, 7))
    if pick == 2:
        return encode_frame(rng.choice([3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF]), payload)
    if pick == 3:
        return encode_frame(OP_CONTINUATION, payload)
    if pick == 4:
        return encode_frame(OP_PING, b"p" * rng.randint(126, 300))
    if pick == 5:
        return encode_frame(OP_BINARY, b"x" * 8, length=rng.choice([MAX_BYTES + 1, 1 << 40]))
    if pick == 6:
        return encode_frame(OP_BINARY, b"ab", fin=False) + encode_frame(OP_TEXT, b"cd")
    if pick == 7:
        return encode_frame(OP_CLOSE, rng.choice([b"\x03", b"\x00\x01", b"\x03\xe8\xff\xfe"]))
    return encode_frame(OP_BINARY, b"x" * (MAX_BYTES + 1))  # oversize, really sent


async def ws_fuzzer(server: RunningCollector, storm: Storm, worker: int) -> None:
    """Bursts of malformed Raccoon messages (each answered with an error), now and then a
    protocol violation (the connection is closed) and a new connection."""
    rng = random.Random(SEED + worker)
    seeds = raccoon_seeds()
    port = server.server.port
    conn = 0
    while not storm.stop.is_set():
        conn += 1
        ws = await RawWebSocket.connect(
            "127.0.0.1", port, headers={"X-User-ID": f"fuzz-{worker}-{conn}"}
        )
        try:
            while not storm.stop.is_set():
                if rng.random() < 0.03:
                    ws.send_raw(ws_junk_frame(rng))
                    await ws.drain()
                    storm.count("ws-protocol")
                    frame = await ws.recv_data(10)
                    if frame is not None and frame.close_code not in (1002, 1007, 1009):
                        storm.wrong(f"WebSocket junk answered with {frame}")
                    break
                burst = rng.randint(1, 16)
                kinds = []
                for _ in range(burst):
                    if rng.random() < 0.7:
                        ws.send_frame(OP_BINARY, malformed_raccoon(rng, seeds))
                        kinds.append("ws-protobuf")
                    else:
                        ws.send_frame(OP_TEXT, malformed_raccoon_json(rng).encode())
                        kinds.append("ws-json")
                await ws.drain()
                for kind in kinds:
                    frame = await ws.recv_data(10)
                    storm.count(kind)
                    check_ws_error(storm, frame)
        finally:
            await ws.close()


def check_ws_error(storm: Storm, frame: Any) -> None:
    if frame is None or frame.opcode not in (OP_BINARY, OP_TEXT):
        storm.wrong(f"malformed message got {frame} instead of an error response")
    elif frame.opcode == OP_BINARY:
        r = raccoon_response(frame.payload)
        if r.status != raccoon.Status.ERROR or r.code != raccoon.Code.BAD_REQUEST or not r.reason:
            storm.wrong(f"binary answer {r}")
    else:
        doc = json.loads(frame.payload)
        if doc.get("status") != 2 or doc.get("code") != 2 or not doc.get("reason"):
            storm.wrong(f"JSON answer {doc}")


# -- malformed HTTP traffic -------------------------------------------------------------------

HttpCase = tuple[str, str, bytes, dict[str, str], set[int]]  # method, path, body, headers, ok


def http_case(rng: random.Random, seeds: list[bytes], otlp_bytes: bytes) -> HttpCase:
    """One malformed HTTP request and the statuses that are a correct refusal of it."""
    key = {"X-Write-Key": KEY}
    pick = rng.randrange(16)
    if pick <= 2:  # Raccoon REST: mutated protobuf or JSON with a right content type
        if rng.random() < 0.6:
            body = malformed_raccoon(rng, seeds)
            ctype = rng.choice(["application/proto", "application/x-protobuf"])
        else:
            body = malformed_raccoon_json(rng).encode()
            ctype = "application/json"
        return "POST", "/api/v1/events", body, {"Content-Type": ctype}, {400}
    if pick == 3:  # Raccoon REST: a valid request with a wrong or missing content type
        body = raccoon_request("ct", [("fuzz", b"x")])
        ctype = rng.choice(["text/plain", "", "multipart/form-data", "application/xml", "proto"])
        headers = {"Content-Type": ctype} if ctype else {}
        return "POST", "/api/v1/events", body, headers, {415}
    if pick <= 7:  # the JSON APIs: mutated bodies with a valid key
        path, doc = rng.choice(
            [(f"/v1/{k}", d) for k, d in SEGMENT_SEEDS]
            + [(f"/api/s/{t}", d) for t, d in JITSU_TYPED_SEEDS]
            + [("/api/v1/event", d) for d in JITSU_CLASSIC_SEEDS]
            + [("/v1/logs", OTLP_JSON_SEED)]
        )
        while True:
            body = mutate_json(rng, doc)
            if json_api_refuses(path, body, "application/json", None):
                return "POST", path, body, {**key, "Content-Type": "application/json"}, {400}
    if pick == 8:  # OTLP protobuf, mutated
        while True:
            body = mutate_bytes(rng, otlp_bytes)
            if json_api_refuses("/v1/logs", body, "application/x-protobuf", None):
                headers = {**key, "Content-Type": "application/x-protobuf"}
                return "POST", "/v1/logs", body, headers, {400}
    if pick == 9:  # OTLP with a content type it does not speak
        ctype = rng.choice(["text/plain", "application/xml", "application/grpc", ""])
        return "POST", "/v1/logs", otlp_bytes, {**key, "Content-Type": ctype}, {415}
    if pick == 10:  # valid bodies with an unknown or no write key
        path, doc = rng.choice(
            [(f"/v1/{k}", d) for k, d in SEGMENT_SEEDS]
            + [(f"/api/s/{t}", d) for t, d in JITSU_TYPED_SEEDS]
            + [("/api/v1/event?token=wrong", d) for d in JITSU_CLASSIC_SEEDS]
        )
        wrong = rng.choice([{"X-Write-Key": "wrong"}, {}, {"Authorization": "Basic !!!"}])
        headers = {**wrong, "Content-Type": "application/json"}
        return "POST", path, json.dumps(doc).encode(), headers, {401}
    if pick == 11:  # gzip that is broken
        path, doc = rng.choice([(f"/v1/{k}", d) for k, d in SEGMENT_SEEDS])
        packed = gzip.compress(json.dumps(doc).encode())
        cut = rng.choice([packed[: rng.randrange(len(packed))], mutate_bytes(rng, packed)])
        if not json_api_refuses(path, cut, "application/json", "gzip"):
            cut = b"\x1f\x8b" + b"\x00" * 4  # too short to be gzip
        headers = {**key, "Content-Type": "application/json", "Content-Encoding": "gzip"}
        return "POST", path, cut, headers, {400}
    if pick == 12:  # codings the collector does not undo
        coding = rng.choice(["br", "zstd", "gzip, gzip, gzip", "compress"])
        headers = {**key, "Content-Type": "application/json", "Content-Encoding": coding}
        return "POST", "/v1/track", json.dumps(SEGMENT_SEEDS[1][1]).encode(), headers, {415}
    if pick == 13:  # too large: raw, or once inflated
        if rng.random() < 0.5:
            bomb = gzip.compress(b"[" + b" " * (4 * MAX_BYTES) + b"]")
            headers = {**key, "Content-Type": "application/json", "Content-Encoding": "gzip"}
            return "POST", "/v1/batch", bomb, headers, {413}
        big = b"\x0a" + b"\xff" * MAX_BYTES
        return "POST", "/api/v1/events", big, {"Content-Type": "application/proto"}, {413}
    if pick == 14:  # no such route
        path = rng.choice(["/v1/nope", "/api/s/bad type!", "/api/v2/events", "/v1/logs/x", "/"])
        return "POST", path, b"{}", {**key, "Content-Type": "application/json"}, {404}
    method = rng.choice(["PUT", "DELETE", "PATCH"])
    return method, rng.choice(["/v1/batch", "/api/v1/events", "/v1/logs"]), b"{}", key, {405}


async def http_fuzzer(server: RunningCollector, storm: Storm, worker: int) -> None:
    rng = random.Random(SEED + 100 + worker)
    seeds = raccoon_seeds()
    otlp_bytes = otlp_seed()
    timeout = aiohttp.ClientTimeout(total=10)
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        while not storm.stop.is_set():
            method, path, body, headers, ok = http_case(rng, seeds, otlp_bytes)
            storm.count("http")
            try:
                async with s.request(
                    method,
                    server.url + path,
                    data=body,
                    headers=headers,
                    skip_auto_headers=["Content-Type"],
                ) as r:
                    answer = await r.read()
                    status = r.status
            except aiohttp.ServerDisconnectedError:
                if 413 not in ok:  # only a too-large body may be cut off unanswered
                    storm.wrong(f"{method} {path} {headers}: disconnected")
                continue
            if status not in ok and "Content-Encoding" in headers and status in CODING_BUG:
                storm.known_bug += 1
            elif status not in ok:
                storm.wrong(f"{method} {path} {headers} -> {status} {answer[:200]!r}")


def raw_http_junk(rng: random.Random) -> bytes:
    """Bytes the HTTP parser itself must refuse (or answer 4xx)."""
    body = b"\xff" * 8  # no intake can decode this, whatever the parser makes of the rest
    good_head = [
        b"POST /api/v1/events HTTP/1.1",
        b"Host: collector",
        b"Content-Type: application/proto",
        b"Content-Length: 8",
    ]
    pick = rng.randrange(10)
    if pick == 0:
        return rng.randbytes(rng.randint(1, 200)) + b"\r\n\r\n"
    if pick == 1:
        good_head[0] = rng.choice([b"P\x00ST / HTTP/1.1", b"POST  HTTP/1.1", b"POST / HTTP/9.9"])
    elif pick == 2:
        good_head.append(rng.choice([b"NoColon", b"Bad Name: x", b"X: \x00\x01", b": empty"]))
    elif pick == 3:
        good_head.append(b"X-Big: " + b"a" * rng.choice([20_000, 70_000]))
    elif pick == 4:
        good_head[3] = rng.choice(
            [b"Content-Length: abc", b"Content-Length: -1", b"Content-Length: 8, 9"]
        )
    elif pick == 5:
        good_head[3] = b"Transfer-Encoding: chunked"
        chunk = rng.choice([b"zz\r\n\r\n", b"-1\r\n\r\n", b"2\r\nabXY0\r\n\r\n"])
        return b"\r\n".join(good_head) + b"\r\n\r\n" + chunk
    elif pick == 6:
        good_head.append(b"Transfer-Encoding: chunked")  # with a Content-Length: smuggling
    elif pick == 7:
        good_head += [b"X-Many-%d: v" % i for i in range(200)]
    elif pick == 8:
        good_head.insert(1, b" folded: continuation")
    else:
        head = b"\r\n".join(good_head)
        return mutate_bytes(rng, head[: head.index(b"\r\nContent-Length")]) + (
            b"\r\nContent-Length: 8\r\n\r\n" + body
        )
    return b"\r\n".join(good_head) + b"\r\n\r\n" + body


async def raw_http_fuzzer(server: RunningCollector, storm: Storm, worker: int) -> None:
    rng = random.Random(SEED + 200 + worker)
    port = server.server.port
    while not storm.stop.is_set():
        data = raw_http_junk(rng)
        storm.count("raw-http")
        response = await http_exchange("127.0.0.1", port, data, timeout=5, half_close=False)
        if response is not None and not 400 <= response.status < 500:
            storm.wrong(f"raw {data[:120]!r} -> {response.status} {response.body[:200]!r}")


async def grpc_fuzzer(server: RunningCollector, storm: Storm) -> None:
    rng = random.Random(SEED + 300)
    seeds = raccoon_seeds()
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        call = channel.unary_unary(
            raccoon.METHOD,
            request_serializer=lambda b: b,
            response_deserializer=raccoon.SendEventResponse.FromString,
        )
        while not storm.stop.is_set() and storm.malformed["grpc"] < GRPC_SHARE:
            storm.count("grpc")
            response = await call(malformed_raccoon(rng, seeds), timeout=10)
            if response.status != raccoon.Status.ERROR or not response.reason:
                storm.wrong(f"gRPC answer {response}")


# -- slow clients -----------------------------------------------------------------------------


@dataclass
class SlowClients:
    """Connections that never finish what they started."""

    trickling: list[asyncio.StreamWriter] = field(default_factory=list)
    silent: list[asyncio.StreamWriter] = field(default_factory=list)
    half_frames: list[RawWebSocket] = field(default_factory=list)

    async def open(self, port: int, storm: Storm) -> None:
        heads = [
            b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # headers never end
            b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n[",  # nor body
            b"GET /api/v1/events HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nX-Slow: ",
        ]
        for i in range(24):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            if i % 4 == 3:
                self.silent.append(w)  # connects and says nothing
            else:
                w.write(heads[i % 4])
                self.trickling.append(w)
            storm.count("slow")
        for i in range(6):  # WebSockets that send half a frame and stop
            ws = await RawWebSocket.connect("127.0.0.1", port, headers={"X-User-ID": f"half-{i}"})
            ws.send_raw(encode_frame(OP_BINARY, b"0123456789")[:5])
            self.half_frames.append(ws)
            storm.count("slow")

    async def close(self) -> None:
        for w in self.trickling + self.silent:
            await close_writer(w)
        for ws in self.half_frames:
            await ws.close()


async def trickle_until_stopped(slow: SlowClients, storm: Storm) -> None:
    while not storm.stop.is_set():
        try:
            await asyncio.wait_for(storm.stop.wait(), 0.5)
        except TimeoutError:
            for w in slow.trickling:
                w.write(b"a")


async def first_close(ws: RawWebSocket) -> int | None:
    """The code of the close frame the server sent, skipping its pings (not answered: the
    server may be gone, and a reply would only earn a reset)."""
    while True:
        frame = await ws.recv_frame(10)
        if frame is None or frame.opcode == OP_CLOSE:
            return frame.close_code if frame is not None else None


# -- the test ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    elapsed: float
    failures: list[BaseException]
    half_frame_closes: list[int | None]


async def storm_scenario(server: RunningCollector, storm: Storm) -> Outcome:
    port = server.server.port
    slow = SlowClients()
    await slow.open(port, storm)
    started = time.monotonic()
    good: list[Awaitable[None]] = [good_websocket(server, storm), good_segment(server, storm)]
    bad: list[Awaitable[None]] = [
        *(ws_fuzzer(server, storm, i) for i in range(4)),
        *(http_fuzzer(server, storm, i) for i in range(3)),
        *(raw_http_fuzzer(server, storm, i) for i in range(2)),
        grpc_fuzzer(server, storm),
        trickle_until_stopped(slow, storm),
    ]
    tasks = [asyncio.ensure_future(c) for c in [*good, *bad]]
    for t in tasks:  # a client that fails ends the storm early: no waiting for the deadline
        t.add_done_callback(lambda t: None if t.exception() is None else storm.stop.set())
    try:
        async with asyncio.timeout(STORM_DEADLINE_S):
            await storm.stop.wait()
    except TimeoutError:
        storm.stop.set()
    elapsed = time.monotonic() - started
    async with asyncio.timeout(30):
        results = await asyncio.gather(*tasks, return_exceptions=True)
    closes = [await first_close(ws) for ws in slow.half_frames]
    await slow.close()
    # The server still takes new clients.
    async with aiohttp.ClientSession() as s:
        for path in ("/healthz", "/readyz"):
            async with s.get(server.url + path) as r:
                assert r.status == 200, (path, await r.text())
    return Outcome(elapsed, [r for r in results if isinstance(r, BaseException)], closes)


def test_malformed_storm_leaves_good_clients_undisturbed(bus: EmbeddedBus) -> None:
    storms: list[Storm] = []

    async def scenario(server: RunningCollector) -> Outcome:
        storms.append(Storm())  # made inside the loop its Event belongs to
        return await storm_scenario(server, storms[0])

    with running_collector(bus, CONFIG) as server:
        outcome = asyncio.run(scenario(server))
    storm, elapsed = storms[0], outcome.elapsed
    print(
        f"seed {SEED}: {storm.malformed.total()} malformed requests in {elapsed:.1f}s "
        f"{dict(storm.malformed)}; {storm.good_acks} good requests acked, "
        f"slowest {storm.good_latency_max * 1000:.0f} ms; {storm.known_bug} hit the coding bug"
    )
    assert not outcome.failures, f"seed {SEED}: {outcome.failures!r}"
    assert storm.unexpected == [], f"seed {SEED}"
    assert storm.malformed.total() >= MIN_MALFORMED, f"only {storm.malformed} in {elapsed:.1f}s"
    assert storm.good_acks >= 50
    # WebSockets that sent half a frame and nothing since were closed by the keepalive.
    assert outcome.half_frame_closes == [1001] * len(outcome.half_frame_closes)

    # The log holds exactly the good events: every one, once, and nothing else.
    assert {t.name for t in bus.topics()} == GOOD_TOPICS
    stored: collections.Counter[tuple[str, bytes]] = collections.Counter()
    for info in bus.topics():
        for p in range(info.partitions):
            stored.update((info.name, r.value) for r in bus.read(info.name, p, 0, 1_000_000))
    assert stored == collections.Counter(storm.good_sent)


def test_slow_http_clients_are_cut_off_after_the_request_timeout(bus: EmbeddedBus) -> None:
    config = CONFIG.model_copy(
        update={"limits": LIMITS.model_copy(update={"request_timeout_s": 0.5})}
    )

    async def unfinished(port: int, start: bytes) -> bytes | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(start)
        try:
            return await asyncio.wait_for(reader.read(), 3)  # what came before the close
        except TimeoutError:
            return None  # still open at 6x the timeout
        finally:
            await close_writer(writer)

    async def scenario(port: int) -> list[bytes | None]:
        return await asyncio.gather(
            unfinished(port, b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nX-Slow: "),  # head
            unfinished(port, b"POST /v1/batch HTTP/1.1\r\nContent-Length: 100\r\n\r\n["),
        )

    with running_collector(bus, config) as server:
        answers = asyncio.run(scenario(server.server.port))
    assert None not in answers, "the server closed (or answered 408) within the deadline"


def test_content_codings_are_undone_by_the_collector_alone(bus: EmbeddedBus) -> None:
    event = json.dumps({"event": "Zipped", "userId": "u1"}).encode()
    cases = [
        ("gzip", gzip.compress(event), 200),
        ("deflate", zlib.compress(event), 200),
        ("gzip", gzip.compress(event)[:-6], 400),
        ("br", event, 415),
    ]

    async def scenario(server: RunningCollector) -> list[tuple[int, Any]]:
        out = []
        async with aiohttp.ClientSession() as s:
            for coding, body, _ in cases:
                headers = {
                    "X-Write-Key": KEY,
                    "Content-Type": "application/json",
                    "Content-Encoding": coding,
                }
                async with s.post(server.url + "/v1/track", data=body, headers=headers) as r:
                    out.append((r.status, await r.json(content_type=None)))
        return out

    with running_collector(bus, CONFIG) as server:
        answers = asyncio.run(scenario(server))
    assert [status for status, _ in answers] == [want for _, _, want in cases], answers
    assert [body.get("code") for _, body in answers[2:]] == ["bad_encoding", "unsupported_encoding"]
    stored = [orjson.loads(r.value)["event"] for r in bus.read("events-track", 0, 0)]
    stored += [orjson.loads(r.value)["event"] for r in bus.read("events-track", 1, 0)]
    assert stored == ["Zipped", "Zipped"]
