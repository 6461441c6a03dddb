"""RFC 6455 conformance of the collector's own WebSocket connections, case by case.

Every case is raw bytes written to a socket (``headwater.testing.clients.RawWebSocket``), so that
each bit of each frame is the test's to choose, and each asserts what the RFC requires of the
server: the close code it sends (then the end of the TCP connection), the pong that echoes a
ping's payload, or the message taken (a Raccoon request answered, naming its ``req_guid``). The
cases follow the groups of Autobahn|Testsuite, the reference suite for WebSocket servers:
framing and masking (its 1.x), pings and pongs (2.x), reserved bits (3.x), opcodes (4.x),
fragmentation (5.x), UTF-8 (6.x), closing (7.x), limits (9.x) and permessage-deflate (12.x and
13.x; here also with a real client, the ``websockets`` library with compression on). The table
runs over both ways a connection becomes a WebSocket: an upgrade as its first request (taken
before aiohttp parses anything) and an upgrade after a GET on the same kept-alive connection
(parsed by aiohttp, then handed to the same code).

Autobahn|Testsuite itself does not run here. ``pip download autobahntestsuite`` fetches 25.10.1,
but that release is Python 2.7 only (it pins Twisted 19.10.0 and autobahn 0.10.9, and its modules
do not parse as Python 3); this machine has no Python 2 interpreter, and the suite's other form
is a Docker image, which is not available. This table stands in for it.

Where the RFCs leave a choice, the collector's is asserted: a text message's UTF-8 is checked
once the message is whole (Autobahn rates a later failure on its fail-fast cases 6.4.x
"non-strict", not failed); a close frame is answered with its code alone; and a compressed
message whose data does not inflate fails with 1007 (RFC 7692 says only that the connection
fails: its frames are well formed, the data in them is not what the message says it is).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.collector.config import CollectorConfig
from headwater.collector.protocols import raccoon
from headwater.testing.clients import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    HandshakeFailed,
    RawWebSocket,
    apply_mask,
    encode_frame,
    raccoon_request,
    raccoon_response,
)
from headwater.testing.collector import RunningCollector, running_collector
from headwater.testing.waiting import wait_until

LIMIT = 256 * 1024  # collector.limits.max_frame_bytes of the server under test
USER = {"X-User-ID": "conformance"}
DEFLATE = {**USER, "Sec-WebSocket-Extensions": "permessage-deflate"}
DEADLINE_S = 10.0
TOPIC = "clickstream-conformance-log"

Reply = tuple[str, Any]  # ("ok" | "error", req_guid), ("pong", payload) or ("close", code)


@pytest.fixture(params=[None, "/healthz"], ids=["first-request", "after-a-get"])
def after_get(request: pytest.FixtureRequest) -> str | None:
    """How the connection is upgraded: as its first request (taken before aiohttp parses it), or
    after a GET on the same kept-alive connection (parsed by aiohttp, then taken from it)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def server(bus: EmbeddedBus) -> Iterator[RunningCollector]:
    limits = CollectorConfig().limits.model_copy(update={"max_frame_bytes": LIMIT})
    with running_collector(bus, CollectorConfig(limits=limits)) as running:
        yield running


# -- what the client sends --------------------------------------------------------------------
def binary(guid: str, pad: int = 0) -> bytes:
    """A protobuf Raccoon request of one event (``pad`` bytes longer)."""
    return raccoon_request(guid, [("conformance", guid.encode() + b"x" * pad)])


def text(guid: str) -> bytes:
    """A JSON Raccoon request of one event, as UTF-8 (the guid may hold any character)."""
    event = {"eventBytes": base64.b64encode(guid.encode()).decode(), "type": "conformance"}
    return json.dumps({"reqGuid": guid, "events": [event]}, ensure_ascii=False).encode()


def sized(guid: str, size: int) -> bytes:
    """A protobuf request of exactly ``size`` bytes."""
    pad = size - len(binary(guid))
    while len(data := binary(guid, pad)) > size:  # (a longer length field takes bytes)
        pad -= 1
    assert len(data) == size
    return data


def frame(opcode: int, payload: bytes = b"", **kwargs: Any) -> bytes:
    return encode_frame(opcode, payload, **kwargs)


def long_length(opcode: int, payload: bytes, code: int, length: bytes) -> bytes:
    """A frame whose length is given in the 16-bit (``code`` 126) or 64-bit (127) field as
    ``length`` says, whatever its value."""
    key = b"\x01\x02\x03\x04"
    return bytes((0x80 | opcode, 0x80 | code)) + length + key + apply_mask(payload, key)


def close(code: int | None = None, reason: bytes = b"") -> bytes:
    return frame(OP_CLOSE, b"" if code is None else struct.pack("!H", code) + reason)


def deflated(message: bytes) -> bytes:
    """A message's bytes as permessage-deflate sends them (no context kept)."""
    compressor = zlib.compressobj(wbits=-15)
    body = compressor.compress(message) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return body[:-4]


def fragments(opcode: int, message: bytes, cuts: list[int], **first: Any) -> bytes:
    """``message`` as fragments cut at the offsets ``cuts``."""
    bounds = [0, *cuts, len(message)]
    parts = [message[a:b] for a, b in itertools.pairwise(bounds)]
    return b"".join(
        frame(
            opcode if i == 0 else OP_CONTINUATION,
            part,
            fin=i == len(parts) - 1,
            **(first if i == 0 else {}),
        )
        for i, part in enumerate(parts)
    )


# -- what the server answers ------------------------------------------------------------------
def ok(guid: str) -> Reply:
    return ("ok", guid)


def pong(payload: bytes) -> Reply:
    return ("pong", payload)


def closed(code: int | None) -> Reply:
    return ("close", code)


@dataclass(frozen=True)
class Step:
    """Bytes to send (a tuple: written one part at a time, each drained), then the replies the
    server sends for them (in any order: requests are answered as they complete)."""

    send: bytes | tuple[bytes, ...]
    replies: tuple[Reply, ...] = ()


@dataclass(frozen=True)
class Case:
    steps: tuple[Step, ...]
    deflate: bool = False  # the connection negotiates permessage-deflate


def case(name: str, *data: bytes, expect: tuple[Reply, ...] = (), deflate: bool = False) -> Any:
    """One step: ``data`` in one write, then ``expect``."""
    return pytest.param(Case((Step(b"".join(data), expect),), deflate), id=name)


def steps(name: str, *parts: Step) -> Any:
    return pytest.param(Case(parts), id=name)


def fails(name: str, *data: bytes, code: int = 1002, deflate: bool = False) -> Any:
    return case(name, *data, expect=(closed(code),), deflate=deflate)


async def next_reply(ws: RawWebSocket) -> Reply | None:
    """The server's next frame as a reply (its keepalive pings skipped); None at EOF."""
    while True:
        got = await ws.recv_frame(DEADLINE_S)
        if got is None:
            return None
        if got.opcode == OP_PONG:
            return pong(got.payload)
        if got.opcode == OP_CLOSE:
            return closed(got.close_code)
        if got.opcode == OP_TEXT:
            doc = json.loads(got.payload)
            status, guid = doc["status"], doc.get("data", {}).get("req_guid", "")
        elif got.opcode == OP_BINARY:
            response = raccoon_response(got.payload)
            status, guid = response.status, response.data["req_guid"]
        else:
            continue
        return ("ok" if status == raccoon.Status.SUCCESS else "error", guid)


async def converse(
    port: int, conformance: Case, after_get: str | None
) -> tuple[list[list[Reply]], bool]:
    """Play the case's steps; unless the server closed, close with 1000 (its echo is the last
    reply). Returns the replies of each step and whether the TCP connection then ended."""
    ws = await RawWebSocket.connect(
        "127.0.0.1", port, headers=DEFLATE if conformance.deflate else USER, after_get=after_get
    )
    transcript: list[list[Reply]] = []
    try:
        for step in conformance.steps:
            for part in step.send if isinstance(step.send, tuple) else (step.send,):
                ws.send_raw(part)
                with contextlib.suppress(ConnectionError):  # (the server may have failed it)
                    await ws.drain()
            got: list[Reply] = []
            while len(got) < len(step.replies) and (reply := await next_reply(ws)) is not None:
                got.append(reply)
                if reply[0] == "close":
                    break
            transcript.append(got)
            if got and got[-1][0] == "close":
                break
        else:
            ws.send_raw(close(1000, b"done"))
            await ws.drain()
            transcript.append([reply] if (reply := await next_reply(ws)) else [])
        ended = await ws.recv_frame(DEADLINE_S) is None
    finally:
        await ws.close()
    return transcript, ended


def expected(conformance: Case) -> list[list[Reply]]:
    out = [list(step.replies) for step in conformance.steps]
    if not out[-1] or out[-1][-1][0] != "close":
        out.append([closed(1000)])
    return out


THE_TABLE = [
    # framing and masking (Autobahn 1.x; masking is RFC 6455 5.3)
    case("text", frame(OP_TEXT, text("t-1")), expect=(ok("t-1"),)),
    case("binary", frame(OP_BINARY, binary("b-1")), expect=(ok("b-1"),)),
    case("16-bit length", frame(OP_BINARY, binary("b-16", 300)), expect=(ok("b-16"),)),
    case("64-bit length", frame(OP_BINARY, binary("b-64", 70_000)), expect=(ok("b-64"),)),
    case(
        "twenty messages in one write",
        *(frame(OP_BINARY, binary(f"m-{i}")) for i in range(20)),
        expect=tuple(ok(f"m-{i}") for i in range(20)),
    ),
    steps(
        "a frame written byte by byte",
        Step(tuple(bytes((b,)) for b in frame(OP_BINARY, binary("bytewise"))), (ok("bytewise"),)),
    ),
    case(
        "a zero masking key", frame(OP_BINARY, binary("zero"), key=b"\0" * 4), expect=(ok("zero"),)
    ),
    fails("unmasked text", frame(OP_TEXT, text("u"), mask=False)),
    fails("unmasked ping", frame(OP_PING, b"p", mask=False)),
    fails("unmasked close", frame(OP_CLOSE, b"\x03\xe8", mask=False)),
    fails(
        "unmasked continuation",
        frame(OP_BINARY, b"a", fin=False) + frame(OP_CONTINUATION, b"b", mask=False),
    ),
    fails("16-bit length under 126", long_length(OP_BINARY, b"x" * 7, 126, struct.pack("!H", 7))),
    fails("64-bit length under 65536", long_length(OP_BINARY, b"x" * 9, 127, struct.pack("!Q", 9))),
    fails(
        "64-bit length with its top bit set", long_length(OP_BINARY, b"", 127, b"\x80" + b"\0" * 7)
    ),
    # pings and pongs (2.x)
    case("empty ping", frame(OP_PING), expect=(pong(b""),)),
    case("ping with text", frame(OP_PING, b"Hello, world!"), expect=(pong(b"Hello, world!"),)),
    case(
        "ping with 125 bytes", frame(OP_PING, bytes(range(125))), expect=(pong(bytes(range(125))),)
    ),
    fails("ping with 126 bytes", frame(OP_PING, b"p" * 126)),
    fails("fragmented ping", frame(OP_PING, b"p", fin=False) + frame(OP_CONTINUATION, b"q")),
    fails("fragmented pong", frame(OP_PONG, b"p", fin=False) + frame(OP_CONTINUATION, b"q")),
    case(
        "unsolicited pongs are ignored",
        frame(OP_PONG),
        frame(OP_PONG, b"unasked"),
        frame(OP_BINARY, binary("after-pong")),
        expect=(ok("after-pong"),),
    ),
    case(
        "ten pings",
        *(frame(OP_PING, b"%d" % i) for i in range(10)),
        expect=tuple(pong(b"%d" % i) for i in range(10)),
    ),
    steps(
        "a ping written byte by byte",
        Step(tuple(bytes((b,)) for b in frame(OP_PING, b"slow")), (pong(b"slow"),)),
    ),
    # reserved bits, with no extension negotiated (3.x)
    fails("RSV3 on text", frame(OP_TEXT, text("r"), rsv=1)),
    fails("RSV2 on text", frame(OP_TEXT, text("r"), rsv=2)),
    fails("RSV2+3 on text", frame(OP_TEXT, text("r"), rsv=3)),
    fails("RSV1 on text", frame(OP_TEXT, text("r"), rsv=4)),
    fails("RSV1+3 on binary", frame(OP_BINARY, binary("r"), rsv=5)),
    fails("RSV1+2 on ping", frame(OP_PING, b"r", rsv=6)),
    fails("all RSV on close", frame(OP_CLOSE, b"\x03\xe8", rsv=7)),
    # opcodes (4.x)
    *(fails(f"reserved data opcode {op:#x}", frame(op, b"reserved")) for op in range(3, 8)),
    *(fails(f"reserved control opcode {op:#x}", frame(op, b"")) for op in range(0xB, 0x10)),
    # fragmentation (5.x)
    case("text in two fragments", fragments(OP_TEXT, text("f-2"), [7]), expect=(ok("f-2"),)),
    case(
        "binary in fragments, the first and last empty",
        fragments(OP_BINARY, binary("f-e"), [0, 3, 9, len(binary("f-e"))]),
        expect=(ok("f-e"),),
    ),
    case(
        "a ping between fragments",
        frame(OP_TEXT, text("f-p")[:5], fin=False),
        frame(OP_PING, b"between"),
        frame(OP_CONTINUATION, text("f-p")[5:]),
        expect=(pong(b"between"), ok("f-p")),
    ),
    case(
        "a pong between fragments",
        frame(OP_BINARY, binary("f-q")[:4], fin=False),
        frame(OP_PONG, b"between"),
        frame(OP_CONTINUATION, binary("f-q")[4:]),
        expect=(ok("f-q"),),
    ),
    steps(
        "fragments and pings in separate writes",
        Step(frame(OP_TEXT, text("f-s")[:3], fin=False) + frame(OP_PING, b"1"), (pong(b"1"),)),
        Step(
            frame(OP_CONTINUATION, text("f-s")[3:9], fin=False) + frame(OP_PING, b"2"),
            (pong(b"2"),),
        ),
        Step(frame(OP_CONTINUATION, text("f-s")[9:]), (ok("f-s"),)),
    ),
    case(
        "a close between fragments",
        frame(OP_BINARY, b"part", fin=False),
        close(1000),
        expect=(closed(1000),),
    ),
    fails("a final continuation with nothing to continue", frame(OP_CONTINUATION, b"x")),
    fails(
        "a continuation after a whole message",
        frame(OP_BINARY, binary("whole")) + frame(OP_CONTINUATION, b"x", fin=False),
    ),
    fails("a first continuation with nothing to continue", frame(OP_CONTINUATION, b"x", fin=False)),
    fails(
        "a whole text in the middle of a fragmented one",
        frame(OP_TEXT, b"{", fin=False) + frame(OP_TEXT, b"{}"),
    ),
    fails(
        "a new fragmented message in the middle of another",
        frame(OP_BINARY, b"a", fin=False) + frame(OP_BINARY, b"b", fin=False),
    ),
    fails(
        "a long ping between fragments",
        frame(OP_BINARY, b"a", fin=False) + frame(OP_PING, b"p" * 126),
    ),
    # UTF-8 in text messages (6.x)
    case(
        "text with every width of character",
        frame(OP_TEXT, text("κόσμε-€-𝄞")),
        expect=(ok("κόσμε-€-𝄞"),),
    ),
    case(
        "text cut inside a four-byte character",
        fragments(OP_TEXT, text("𝄞"), [text("𝄞").index("𝄞".encode()) + 2]),
        expect=(ok("𝄞"),),
    ),
    case(
        "text with every byte its own fragment",
        fragments(OP_TEXT, text("κόσμε-𝄞"), list(range(1, len(text("κόσμε-𝄞"))))),
        expect=(ok("κόσμε-𝄞"),),
    ),
    case(
        "text with empty fragments",
        fragments(OP_TEXT, text("é"), [0, 0, len(text("é"))]),
        expect=(ok("é"),),
    ),
    case("an empty text message is taken", frame(OP_TEXT), expect=(("error", ""),)),
    fails("text with 0xff", frame(OP_TEXT, b"ab\xffcd"), code=1007),
    fails("text with a lone continuation byte", frame(OP_TEXT, b"\x80"), code=1007),
    fails("text with an overlong slash", frame(OP_TEXT, b"\xc0\xaf"), code=1007),
    fails("text with a surrogate", frame(OP_TEXT, b"\xed\xa0\x80"), code=1007),
    fails("text above U+10FFFF", frame(OP_TEXT, b"\xf4\x90\x80\x80"), code=1007),
    fails("text ending inside a character", frame(OP_TEXT, b"\xce\xba\xe1"), code=1007),
    fails(
        "invalid UTF-8 split across fragments",
        frame(OP_TEXT, b"\xce", fin=False) + frame(OP_CONTINUATION, b"("),
        code=1007,
    ),
    fails(
        "a character cut and never finished",
        frame(OP_TEXT, b"abc\xf0\x9f", fin=False) + frame(OP_CONTINUATION, b"\x98a"),
        code=1007,
    ),
    # closing (7.x)
    case("close 1000", close(1000), expect=(closed(1000),)),
    case("close after close", close(1000), close(1001), expect=(closed(1000),)),
    case("a ping after close", close(1000), frame(OP_PING, b"late"), expect=(closed(1000),)),
    case(
        "a message after close",
        close(1000),
        frame(OP_BINARY, binary("late")),
        expect=(closed(1000),),
    ),
    case(
        "a fragment after close",
        frame(OP_TEXT, b"{", fin=False),
        close(1000),
        frame(OP_CONTINUATION, b"}"),
        expect=(closed(1000),),
    ),
    case("an empty close", close(), expect=(closed(None),)),
    fails("a close of one byte", frame(OP_CLOSE, b"\x03")),
    case("close with a reason", close(1000, b"bye"), expect=(closed(1000),)),
    case("close with a 123-byte reason", close(1000, b"r" * 123), expect=(closed(1000),)),
    fails("close with a 124-byte reason", close(1000, b"r" * 124)),
    fails("close with a reason that is not UTF-8", close(1000, b"\xce\xba\xff"), code=1007),
    *(
        case(f"close with code {code}", close(code), expect=(closed(code),))
        for code in (
            1000,
            1001,
            1002,
            1003,
            1007,
            1008,
            1009,
            1010,
            1011,
            1012,
            1013,
            1014,
            3000,
            3999,
            4000,
            4999,
        )
    ),
    *(
        fails(f"close with invalid code {code}", close(code))
        for code in (0, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535)
    ),
    # limits (9.x): collector.limits.max_frame_bytes
    case("a message of the limit", frame(OP_BINARY, sized("limit", LIMIT)), expect=(ok("limit"),)),
    fails(
        "a message one byte over the limit", frame(OP_BINARY, sized("over", LIMIT + 1)), code=1009
    ),
    fails("a text one byte over the limit", frame(OP_TEXT, b" " * (LIMIT + 1)), code=1009),
    fails(
        "fragments one byte over the limit",
        fragments(OP_BINARY, sized("over", LIMIT + 1), [LIMIT // 2]),
        code=1009,
    ),
    fails("a length of 2^40 sent alone", frame(OP_BINARY, b"", length=1 << 40)[:10], code=1009),
    fails("a message 32 times the limit", frame(OP_BINARY, b"x" * (32 * LIMIT)), code=1009),
    # permessage-deflate (RFC 7692; Autobahn 12.x and 13.x)
    case(
        "a compressed message",
        frame(OP_BINARY, deflated(binary("z-1")), rsv=4),
        frame(OP_BINARY, binary("plain")),
        expect=(ok("z-1"), ok("plain")),
        deflate=True,
    ),
    case(
        "a compressed text in fragments",
        fragments(OP_TEXT, deflated(text("κόσμε-z")), [3, 11], rsv=4),
        expect=(ok("κόσμε-z"),),
        deflate=True,
    ),
    fails(
        "RSV1 on a continuation",
        frame(OP_BINARY, b"a", fin=False) + frame(OP_CONTINUATION, b"b", rsv=4),
        deflate=True,
    ),
    fails("RSV1 on a ping", frame(OP_PING, deflated(b"p"), rsv=4), deflate=True),
    fails("RSV2 with deflate", frame(OP_BINARY, binary("r"), rsv=2), deflate=True),
    fails(
        "a compressed message that does not inflate",
        frame(OP_BINARY, b"\xff\xfe\xfd", rsv=4),
        code=1007,
        deflate=True,
    ),
    fails(
        "a compressed message that inflates over the limit",
        frame(OP_BINARY, deflated(b"\0" * (LIMIT + 1)), rsv=4),
        code=1009,
        deflate=True,
    ),
]


@pytest.mark.parametrize("conformance", THE_TABLE)
def test_rfc6455(server: RunningCollector, conformance: Case, after_get: str | None) -> None:
    transcript, ended = asyncio.run(converse(server.server.port, conformance, after_get))
    assert [sorted(r, key=repr) for r in transcript] == [
        sorted(r, key=repr) for r in expected(conformance)
    ]
    assert ended  # after the close frame, the TCP connection ends, with nothing else sent


# -- the handshake ----------------------------------------------------------------------------
def test_frames_sent_with_the_handshake_are_taken(
    server: RunningCollector, after_get: str | None
) -> None:
    """A client may write its first frames right behind the handshake, before the 101 (and a
    frame cut there): the bytes that came with the head are the WebSocket's."""
    second = frame(OP_BINARY, binary("early-2"))

    async def scenario() -> list[Reply | None]:
        ws = await RawWebSocket.connect(
            "127.0.0.1",
            server.server.port,
            headers=USER,
            after_get=after_get,
            early=frame(OP_BINARY, binary("early-1")) + frame(OP_PING, b"early") + second[:7],
        )
        try:
            ws.send_raw(second[7:])
            await ws.drain()
            return [await next_reply(ws) for _ in range(3)]
        finally:
            await ws.close()

    replies = asyncio.run(scenario())
    assert sorted(replies, key=repr) == sorted(
        [ok("early-1"), pong(b"early"), ok("early-2")], key=repr
    )


@pytest.mark.parametrize(
    "header", ["Sec-WebSocket-Version", "Sec-WebSocket-Key"], ids=["two versions", "two keys"]
)
def test_a_bad_handshake_is_refused_with_its_reason(
    server: RunningCollector, after_get: str | None, header: str
) -> None:
    async def scenario() -> Any:
        with pytest.raises(HandshakeFailed) as caught:
            await RawWebSocket.connect(
                "127.0.0.1", server.server.port, headers={**USER, header: "13"}, after_get=after_get
            )
        return caught.value.response

    response = asyncio.run(scenario())
    assert response is not None and response.status == 400
    assert header.encode() in response.body  # the handshake's reason, named
    assert response.headers["connection"] == "close"


def test_aiohttp_lets_go_of_a_connection_it_hands_over(server: RunningCollector) -> None:
    """After the upgrade on a kept-alive connection, aiohttp's server holds nothing of it (no
    handler that its keep-alive timer or its shutdown would close), and the WebSocket goes on."""
    aiohttp_server = server.server._runner.server  # type: ignore[union-attr]
    assert aiohttp_server is not None

    async def scenario() -> list[Reply | None]:
        ws = await RawWebSocket.connect(
            "127.0.0.1", server.server.port, headers=USER, after_get="/healthz"
        )
        try:
            ws.send_raw(frame(OP_BINARY, binary("handed-1")))
            first = await next_reply(ws)
            await asyncio.to_thread(
                wait_until, lambda: not aiohttp_server.connections, "aiohttp lets go", DEADLINE_S
            )
            ws.send_raw(frame(OP_BINARY, binary("handed-2")))
            return [first, await next_reply(ws)]
        finally:
            await ws.close()

    assert asyncio.run(scenario()) == [ok("handed-1"), ok("handed-2")]


# -- permessage-deflate from a real client ----------------------------------------------------
def test_a_compressing_client_sends_compressed_frames_that_are_taken(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    events = [b'{"page": "/home", "padding": "%s"}' % (b"abc" * 3000) for _ in range(5)]

    async def scenario() -> tuple[list[str], int, int]:
        async with connect(server.ws_url, compression="deflate", additional_headers=USER) as ws:
            written = [0]
            write = ws.transport.write

            def counted(data: Any) -> None:
                written[0] += len(data)
                write(data)

            ws.transport.write = counted  # type: ignore[method-assign]
            guids = []
            for i, event in enumerate(events):
                request = raccoon_request(f"z-{i}", [("conformance", event)])
                await ws.send(request)
                guids.append(raccoon_response(await ws.recv(decode=False)).data["req_guid"])
            return guids, written[0], len(request)

    guids, written, size = asyncio.run(scenario())
    assert guids == [f"z-{i}" for i in range(5)]
    assert written < size  # five messages in fewer bytes than one uncompressed
    assert [r.value for r in bus.read(TOPIC, 0, 0, max_records=10)] == events


def test_a_compressed_message_that_inflates_over_the_limit_is_refused_with_1009(
    server: RunningCollector, bus: EmbeddedBus
) -> None:
    async def scenario() -> int | None:
        async with connect(server.ws_url, compression="deflate", additional_headers=USER) as ws:
            await ws.send(raccoon_request("bomb", [("conformance", b"\0" * LIMIT)]))
            with pytest.raises(ConnectionClosedError) as caught:
                await asyncio.wait_for(ws.recv(), DEADLINE_S)
            return caught.value.rcvd.code if caught.value.rcvd else None

    assert asyncio.run(scenario()) == 1009
    assert TOPIC not in {t.name for t in bus.topics()}  # nothing of it stored
