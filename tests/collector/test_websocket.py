"""The collector's own WebSocket connections: the handshake it takes from aiohttp, the frame
parser's close codes, fragments, permessage-deflate and limits, and, over real sockets, that an
idle connection holds no task while an upgrade on a reused connection still works."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import zlib
from typing import Any

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.collector import websocket
from headwater.collector.protocols import raccoon
from headwater.collector.websocket import BINARY, CLOSE, PING, TEXT, Failure, Frames
from headwater.testing.clients import HandshakeFailed, RawWebSocket, encode_frame, read_response
from headwater.testing.collector import running_collector

PATH = "/api/v1/events"
USER = {"X-User-ID": "user-1"}
KEY = base64.b64encode(os.urandom(16))


def head(*extra: bytes, path: bytes = PATH.encode(), version: bytes = b"13") -> bytes:
    lines = [
        b"GET " + path + b" HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"Sec-WebSocket-Key: " + KEY,
        b"Sec-WebSocket-Version: " + version,
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# -- the handshake --------------------------------------------------------------------------
def test_upgrade_is_decided_from_the_first_bytes() -> None:
    full = head(b"X-User-ID: \xc3\xa9mile", b"X-User-ID: last") + b"\x81\x80"
    for n in (1, 4, 12, len(full) - 10):  # a prefix of an upgrade: wait for more
        assert websocket.take_upgrade(full[:n], PATH) is None
    upgrade = websocket.take_upgrade(full, PATH)
    assert isinstance(upgrade, websocket.Upgrade)
    accept = base64.b64encode(
        hashlib.sha1(KEY + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
    ).decode()
    assert upgrade.response.startswith(b"HTTP/1.1 101 ")
    assert f"Sec-WebSocket-Accept: {accept}\r\n".encode() in upgrade.response
    assert upgrade.headers["x-user-id"] == "last"  # the last of a repeated header, as before
    assert upgrade.rest == b"\x81\x80"  # what the client sent after its head
    assert upgrade.extensions == []
    with_query = websocket.take_upgrade(head(path=b"/api/v1/events?x=1"), PATH)
    assert isinstance(with_query, websocket.Upgrade)


@pytest.mark.parametrize(
    "data",
    [
        b"POST /v1/batch HTTP/1.1\r\n",  # another request: HTTP's
        b"GET /api/v1/eventsX HTTP/1.1\r\n",  # another path
        b"GET /healthz HTTP/1.1\r\n\r\n",
        head(version=b"8"),  # a bad handshake: aiohttp answers it (400)
        head().replace(b"Upgrade: websocket\r\n", b""),
        head(b"Content-Length: 3") + b"abc",
        b"GET /api/v1/events HTTP/1.1\r\n" + b"X: " + b"y" * (40 * 1024),  # too long a head
    ],
)
def test_everything_else_is_left_to_http(data: bytes) -> None:
    assert websocket.take_upgrade(data, PATH) is False


def test_permessage_deflate_is_negotiated_without_a_server_compressor() -> None:
    upgrade = websocket.take_upgrade(
        head(b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits"), PATH
    )
    assert isinstance(upgrade, websocket.Upgrade)
    assert b"permessage-deflate; server_no_context_takeover" in upgrade.response
    assert len(upgrade.extensions) == 1


# -- frames -----------------------------------------------------------------------------------
def feed_bytewise(frames: Frames, data: bytes) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    for i in range(len(data)):
        out += frames.feed(data[i : i + 1])
    return out


def test_messages_controls_and_fragments_in_any_split() -> None:
    big = os.urandom(70_000)  # a 64-bit length
    data = (
        encode_frame(0x2, b"hello")
        + encode_frame(0x1, "é".encode())
        + encode_frame(0x9, b"ping")
        + encode_frame(0x2, b"ab", fin=False)
        + encode_frame(0xA, b"pong between fragments")
        + encode_frame(0x0, b"cd", fin=False)
        + encode_frame(0x0, b"ef")
        + encode_frame(0x2, big)
        + encode_frame(0x2, b"")
    )
    expected = [
        (BINARY, b"hello"),
        (TEXT, "é"),
        (PING, b"ping"),
        (0xA, b"pong between fragments"),
        (BINARY, b"abcdef"),
        (BINARY, big),
        (BINARY, b""),
    ]
    assert Frames(1 << 20, []).feed(data) == expected
    assert feed_bytewise(Frames(1 << 20, []), data) == expected
    whole = Frames(1 << 20, [])
    got: list[tuple[int, Any]] = []
    for at in range(0, len(data), 4096):  # reads of a socket
        got += whole.feed(data[at : at + 4096])
    assert got == expected


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (encode_frame(0x2, b"x", mask=False), 1002),  # clients must mask
        (encode_frame(0x2, b"x", rsv=1), 1002),  # no extension negotiated
        (encode_frame(0x2, b"x", rsv=2), 1002),
        (encode_frame(0x3, b""), 1002),  # reserved opcodes
        (encode_frame(0xB, b""), 1002),
        (encode_frame(0x0, b"x"), 1002),  # nothing to continue
        (encode_frame(0x9, b"p" * 126), 1002),  # control frames <= 125 bytes
        (encode_frame(0x9, b"p", fin=False), 1002),  # and not fragmented
        (encode_frame(0x2, b"a", fin=False) + encode_frame(0x1, b"b"), 1002),
        (encode_frame(0x1, b"\xff\xfe"), 1007),
        (encode_frame(0x1, b"\xc3", fin=False) + encode_frame(0x0, b"(", fin=True), 1007),
        (encode_frame(0x2, b"x" * 1001), 1009),
        (encode_frame(0x2, b"x" * 8, length=1 << 40), 1009),  # refused from its head
        (encode_frame(0x2, b"x" * 600, fin=False) + encode_frame(0x0, b"x" * 401), 1009),
    ],
)
def test_protocol_violations_fail_with_their_close_code(data: bytes, code: int) -> None:
    with pytest.raises(Failure) as caught:
        Frames(1000, []).feed(data)
    assert caught.value.code == code and caught.value.reason


def deflate_frame(message: bytes, compressor: Any, **kwargs: Any) -> bytes:
    body = compressor.compress(message) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return encode_frame(0x2, body[:-4], rsv=4, **kwargs)


def test_compressed_messages_keep_the_clients_context_and_their_limit() -> None:
    upgrade = websocket.take_upgrade(head(b"Sec-WebSocket-Extensions: permessage-deflate"), PATH)
    assert isinstance(upgrade, websocket.Upgrade)
    frames = Frames(10_000, upgrade.extensions)
    compressor = zlib.compressobj(wbits=-15)
    first, second = b"a repeated phrase " * 100, b"a repeated phrase " * 90
    data = deflate_frame(first, compressor) + deflate_frame(second, compressor)
    data += encode_frame(0x2, b"plain")  # uncompressed messages stay allowed
    assert frames.feed(data) == [(BINARY, first), (BINARY, second), (BINARY, b"plain")]
    with pytest.raises(Failure) as caught:  # RSV1 is for a message's first frame only
        Frames(10_000, upgrade.extensions).feed(
            encode_frame(0x2, b"a", fin=False) + encode_frame(0x0, b"b", rsv=4)
        )
    assert caught.value.code == 1002
    bomb = zlib.compressobj(wbits=-15)
    with pytest.raises(Failure) as caught:  # small on the wire, over the limit inflated
        Frames(10_000, upgrade.extensions).feed(deflate_frame(b"\0" * 20_000, bomb))
    assert caught.value.code == 1009


def test_close_frames_are_parsed_with_their_reason() -> None:
    # how a close is answered, and which close frames fail, is asserted over real sockets in
    # test_websocket_conformance.py
    assert Frames(1000, []).feed(encode_frame(0x8, b"\x03\xe8bye")) == [(CLOSE, b"\x03\xe8bye")]


# -- over real sockets ----------------------------------------------------------------------
def request(guid: str) -> bytes:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    req.events.add(type="t", event_bytes=b"e")
    return req.SerializeToString()


def test_idle_connections_hold_no_task_and_a_reused_connection_can_upgrade(
    bus: EmbeddedBus,
) -> None:
    with running_collector(bus) as server:

        def tasks() -> int:
            async def count() -> int:
                return len(asyncio.all_tasks())

            return asyncio.run_coroutine_threadsafe(count(), server.loop).result(10)

        async def scenario() -> tuple[int, int, list[Any], str]:
            before = tasks()
            sockets = [
                await RawWebSocket.connect(
                    "127.0.0.1", server.server.port, headers={"X-User-ID": f"idle-{i}"}
                )
                for i in range(20)
            ]
            answers = []
            for i, ws in enumerate(sockets):
                ws.send_frame(0x2, request(f"idle-{i}"))
                await ws.drain()
                answers.append(await ws.recv_data(10))
            after = tasks()
            for ws in sockets:
                await ws.close()
            # an upgrade as the second request of a kept-alive connection (taken from aiohttp)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            health = await read_response(reader, 10)
            assert health is not None and health.status == 200
            writer.write(head(b"X-User-ID: reused"))
            upgraded = await read_response(reader, 10)
            assert upgraded is not None and upgraded.status == 101
            ws = RawWebSocket(reader, writer)
            ws.send_frame(0x2, request("reused"))
            frame = await ws.recv_data(10)
            await ws.close()
            reused: Any = raccoon.SendEventResponse()
            reused.ParseFromString(frame.payload if frame is not None else b"")
            return before, after, answers, reused.data["req_guid"]

        before, after, answers, reused = asyncio.run(scenario())
    assert after == before  # 20 idle connections, answered, hold no task
    for i, frame in enumerate(answers):
        response: Any = raccoon.SendEventResponse()
        response.ParseFromString(frame.payload)
        assert (response.status, response.data["req_guid"]) == (
            raccoon.Status.SUCCESS,
            f"idle-{i}",
        )
    assert reused == "reused"
    assert len(bus.read("clickstream-t-log", 0, 0, max_records=100)) == 21


def test_pipelined_requests_are_answered_with_at_most_64_in_flight(bus: EmbeddedBus) -> None:
    with running_collector(bus) as server:
        answer = server.server._answer
        now = [0, 0]  # in flight, most seen

        async def counted(sock: Any, data: bytes | str) -> None:
            now[0] += 1
            now[1] = max(now)
            try:
                await answer(sock, data)
            finally:
                now[0] -= 1

        server.server._answer = counted  # type: ignore[method-assign]

        async def scenario() -> set[str]:
            ws = await RawWebSocket.connect(
                "127.0.0.1", server.server.port, headers={"X-User-ID": "pipelined"}
            )
            ws.send_raw(b"".join(encode_frame(0x2, request(f"p-{i}")) for i in range(300)))
            await ws.drain()
            guids = set()
            for _ in range(300):
                frame = await ws.recv_data(10)
                assert frame is not None
                response: Any = raccoon.SendEventResponse()
                response.ParseFromString(frame.payload)
                assert response.status == raccoon.Status.SUCCESS
                guids.add(response.data["req_guid"])
            await ws.close()
            return guids

        guids = asyncio.run(scenario())
    assert guids == {f"p-{i}" for i in range(300)}
    assert now[1] == 64  # the bound was reached, never passed (reading paused meanwhile)


def test_an_upgrade_while_shutting_down_is_told_to_retry(bus: EmbeddedBus) -> None:
    with running_collector(bus) as server:
        server.collector.draining = True  # (as stop() sets it first)
        with pytest.raises(HandshakeFailed) as caught:
            asyncio.run(RawWebSocket.connect("127.0.0.1", server.server.port, headers=USER))
        server.collector.draining = False
    response = caught.value.response
    assert response is not None and response.status == 503
    assert response.headers["retry-after"] == "1"


def test_an_upgrade_that_cannot_be_admitted_is_told_to_retry(bus: EmbeddedBus) -> None:
    with running_collector(bus) as server:

        async def broken(headers: Any, remote: str) -> Any:
            raise RuntimeError("the log's process is gone")

        server.collector.open_connection = broken  # type: ignore[method-assign]
        with pytest.raises(HandshakeFailed) as caught:
            asyncio.run(RawWebSocket.connect("127.0.0.1", server.server.port, headers=USER))
    response = caught.value.response
    assert response is not None and response.status == 503
    assert b"retry shortly" in response.body
