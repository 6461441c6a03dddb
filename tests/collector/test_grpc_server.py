"""The gRPC intake over real loopback sockets, with a real grpc.aio client and no stubs."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import pytest
from grpc import aio
from hpack import Decoder, Encoder

from headwater.collector import http2 as h2
from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Code, Rejected, unavailable
from headwater.collector.grpc_server import MAX_HANDLING, MAX_STREAMS, GrpcServer, length_prefixed
from headwater.collector.protocols import raccoon
from headwater.testing.waiting import until

LIMITS = LimitsConfig()


def request(guid: str = "g-1", n: int = 2, size: int = 10) -> bytes:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    for i in range(n):
        req.events.add(event_bytes=bytes([i % 256]) * size, type=f"type{i}")
    return req.SerializeToString()


def parse_response(data: bytes) -> Any:
    return raccoon.SendEventResponse.FromString(data)


class Recorder:
    """A ``handle`` that decodes with the shared decoder and records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, dict[str, str], str]] = []
        self.intakes: list[Any] = []

    async def __call__(self, raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        self.calls.append((raw, dict(metadata), peer))
        try:
            intake = raccoon.decode_request(raw, LIMITS)
        except Rejected as e:
            return raccoon.error_response_bytes(e)
        self.intakes.append(intake)
        return raccoon.ok_response_bytes(intake.request_id or "")


Handle = Callable[[bytes, Mapping[str, str], str], Awaitable[bytes]]


async def serve(
    handle: Handle, body: Callable[[GrpcServer, aio.Channel], Awaitable[None]], **kw: Any
) -> None:
    server = GrpcServer(handle, "127.0.0.1", 0, kw.get("max_message_bytes", 1 << 20))
    port = await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(server, channel)
    finally:
        await server.stop(5)


def send_event(channel: aio.Channel) -> aio.UnaryUnaryMultiCallable:
    # Identity (de)serializers: the test speaks raw bytes, as a stub-less client would.
    return channel.unary_unary(raccoon.METHOD)


def test_a_good_request_is_decoded_and_acked() -> None:
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        reply = parse_response(await send_event(channel)(request("abc"), timeout=10))
        assert reply.status == raccoon.Status.SUCCESS
        assert reply.code == Code.OK
        assert dict(reply.data) == {"req_guid": "abc"}

    asyncio.run(serve(rec, body))
    [(raw, _, _)] = rec.calls
    assert raw == request("abc")
    [intake] = rec.intakes
    assert [e.type for e in intake.events] == ["type0", "type1"]


def test_a_client_built_from_the_message_classes_works() -> None:
    """A client using our message classes as (de)serializers, as a generated stub would."""
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        call = channel.unary_unary(
            raccoon.METHOD,
            request_serializer=raccoon.SendEventRequest.SerializeToString,
            response_deserializer=raccoon.SendEventResponse.FromString,
        )
        req: Any = raccoon.SendEventRequest(req_guid="typed")
        req.events.add(event_bytes=b"\x08\x01", type="click")
        reply: Any = await call(req, timeout=10)
        assert reply.status == raccoon.Status.SUCCESS
        assert reply.data["req_guid"] == "typed"

    asyncio.run(serve(rec, body))


def test_a_bad_request_gets_an_error_response_not_a_grpc_error() -> None:
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        call = send_event(channel)
        reply = parse_response(await call(b"\x0a\x05ab", timeout=10))
        assert reply.status == raccoon.Status.ERROR
        assert reply.code == Code.BAD_REQUEST
        assert reply.reason.startswith("malformed protobuf: at byte 0 (req_guid)")
        assert dict(reply.data) == {"req_guid": ""}
        empty = parse_response(await call(request("g-9", n=0), timeout=10))
        assert (empty.status, empty.reason) == (raccoon.Status.ERROR, "the request has no events")
        assert empty.data["req_guid"] == "g-9"
        # and the server keeps serving
        ok = parse_response(await call(request("next"), timeout=10))
        assert ok.status == raccoon.Status.SUCCESS

    asyncio.run(serve(rec, body))


def test_an_oversize_message_is_refused_by_grpc_with_resource_exhausted() -> None:
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        call = send_event(channel)
        big = request("big", n=3, size=2000)
        with pytest.raises(aio.AioRpcError) as info:
            await call(big, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = info.value.details() or ""
        assert str(len(big)) in details and "4096" in details
        ok = parse_response(await call(request("small"), timeout=10))
        assert ok.status == raccoon.Status.SUCCESS

    asyncio.run(serve(rec, body, max_message_bytes=4096))
    assert [raw for raw, _, _ in rec.calls] == [request("small")]


def test_metadata_and_peer_reach_the_handler() -> None:
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        metadata = aio.Metadata(
            ("x-user-id", "u-1"),
            ("x-user-id", "u-2"),
            ("x-group", "app"),
            ("trace-bin", b"\x00\x01"),
        )
        await send_event(channel)(request(), metadata=metadata, timeout=10)

    asyncio.run(serve(rec, body))
    [(_, metadata, peer)] = rec.calls
    assert metadata["x-user-id"] == "u-1"
    assert metadata["x-group"] == "app"
    assert "trace-bin" not in metadata
    assert peer == "127.0.0.1"


def test_handler_refusals_and_failures_become_responses() -> None:
    async def refuse(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        if metadata.get("fail") == "yes":
            raise RuntimeError("boom")
        raise unavailable("the log is full", retry_after=3)

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        call = send_event(channel)
        busy = parse_response(await call(request(), timeout=10))
        assert (busy.status, busy.code) == (raccoon.Status.ERROR, Code.INTERNAL_ERROR)
        assert busy.reason == "the log is full"
        assert busy.data["retry_after"] == "3"
        broken = parse_response(await call(request(), metadata=(("fail", "yes"),), timeout=10))
        assert (broken.status, broken.code) == (raccoon.Status.ERROR, Code.INTERNAL_ERROR)
        assert "boom" not in broken.reason

    asyncio.run(serve(refuse, body))


def test_stop_waits_for_the_call_in_flight_and_refuses_new_ones() -> None:
    async def main() -> None:
        entered = asyncio.Event()
        release = asyncio.Event()

        async def slow(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
            if raw == request("slow"):
                entered.set()
                await release.wait()
            return raccoon.ok_response_bytes("slow")

        server = GrpcServer(slow, "127.0.0.1", 0, 1 << 20)
        port = await server.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = send_event(channel)
            in_flight = asyncio.ensure_future(call(request("slow"), timeout=30))
            await entered.wait()
            stopping = asyncio.ensure_future(server.stop(30))
            # Once a new call is refused the server is stopping; the old one must still run.
            # (A late call that slips in before the stop begins is answered at once.)
            async with aio.insecure_channel(f"127.0.0.1:{port}") as fresh:
                while True:
                    try:
                        await send_event(fresh)(request("late"), timeout=10)
                    except aio.AioRpcError as e:
                        # refused at the door, or cancelled by the stop before it was handled
                        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                        break
            assert not stopping.done()
            assert not in_flight.done()
            release.set()
            reply = parse_response(await in_flight)
            assert reply.data["req_guid"] == "slow"
            await stopping

    asyncio.run(main())


def test_a_port_in_use_is_an_error() -> None:
    async def main() -> None:
        first = GrpcServer(Recorder(), "127.0.0.1", 0, 1024)
        port = await first.start()
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await GrpcServer(Recorder(), "127.0.0.1", port, 1024).start()
        finally:
            await first.stop(1)

    asyncio.run(main())


# -- behaviour a grpc.aio client shows ------------------------------------------------------------


def test_an_unknown_method_is_unimplemented_and_the_connection_goes_on() -> None:
    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        with pytest.raises(aio.AioRpcError) as info:
            await channel.unary_unary("/raystack.raccoon.v1beta1.EventService/Other")(
                request(), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "EventService/Other" in (info.value.details() or "")
        ok = parse_response(await send_event(channel)(request("after"), timeout=10))
        assert ok.data["req_guid"] == "after"

    asyncio.run(serve(rec, body))
    assert [raw for raw, _, _ in rec.calls] == [request("after")]


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_a_compressed_request_reaches_the_handler_decompressed(
    compression: grpc.Compression,
) -> None:
    rec = Recorder()
    big = request("zipped", n=50, size=400)  # compresses well

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        reply = parse_response(await send_event(channel)(big, compression=compression, timeout=10))
        assert reply.data["req_guid"] == "zipped"

    asyncio.run(serve(rec, body))
    assert [raw for raw, _, _ in rec.calls] == [big]


def test_calls_on_one_connection_are_answered_each_with_its_own_response() -> None:
    """Twenty calls in flight on one channel, finished by the handler in reverse order."""

    async def main() -> None:
        gates = {f"g-{i}": asyncio.Event() for i in range(20)}
        arrived: list[str] = []

        async def handle(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
            guid = raccoon.decode_request(raw, LIMITS).request_id or ""
            arrived.append(guid)
            await gates[guid].wait()
            return raccoon.ok_response_bytes(guid)

        async def body(server: GrpcServer, channel: aio.Channel) -> None:
            call = send_event(channel)
            calls = [asyncio.ensure_future(call(request(g), timeout=30)) for g in gates]
            while len(arrived) < len(gates):
                await asyncio.wait(calls, timeout=0.05)  # the handlers block: none finishes
            for guid in reversed(list(gates)):
                gates[guid].set()
            replies = [parse_response(r) for r in await asyncio.gather(*calls)]
            assert [r.data["req_guid"] for r in replies] == list(gates)

        await serve(handle, body)

    asyncio.run(main())


def test_a_message_over_many_frames_is_put_back_together() -> None:
    rec = Recorder()
    big = request("big", n=30, size=10_000)  # ~300 kB: many DATA frames

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        reply = parse_response(await send_event(channel)(big, timeout=10))
        assert reply.data["req_guid"] == "big"

    asyncio.run(serve(rec, body))
    assert [raw for raw, _, _ in rec.calls] == [big]


def test_a_cancelled_call_still_runs_its_handler_and_others_are_served() -> None:
    async def main() -> None:
        entered = asyncio.Event()
        release = asyncio.Event()
        finished: list[str] = []

        async def handle(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
            guid = raccoon.decode_request(raw, LIMITS).request_id or ""
            if guid == "slow":
                entered.set()
                await release.wait()
            finished.append(guid)
            return raccoon.ok_response_bytes(guid)

        async def body(server: GrpcServer, channel: aio.Channel) -> None:
            call = send_event(channel)
            slow = call(request("slow"), timeout=30)
            waiting = asyncio.ensure_future(slow)
            await entered.wait()
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            release.set()
            reply = parse_response(await call(request("next"), timeout=10))
            assert reply.data["req_guid"] == "next"

        await serve(handle, body)
        assert sorted(finished) == ["next", "slow"]  # nothing the client sent was dropped

    asyncio.run(main())


def test_a_call_left_running_at_the_end_of_the_grace_is_cancelled() -> None:
    async def main() -> None:
        entered = asyncio.Event()

        async def stuck(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
            entered.set()
            await asyncio.Event().wait()
            raise AssertionError("never released")

        server = GrpcServer(stuck, "127.0.0.1", 0, 1 << 20)
        port = await server.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            in_flight = asyncio.ensure_future(send_event(channel)(request(), timeout=30))
            await entered.wait()
            await server.stop(0.2)
            with pytest.raises(aio.AioRpcError) as info:
                await in_flight
            assert info.value.code() == grpc.StatusCode.CANCELLED
            assert "stopping" in (info.value.details() or "")

    asyncio.run(main())


def test_the_server_runs_on_uvloop() -> None:
    """The intake's loop is uvloop, whose transports are not asyncio's classes."""
    import uvloop

    rec = Recorder()

    async def body(server: GrpcServer, channel: aio.Channel) -> None:
        reply = parse_response(await send_event(channel)(request("uv"), timeout=10))
        assert reply.data["req_guid"] == "uv"

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(rec, body))
    assert len(rec.calls) == 1


# -- HTTP/2 frame by frame ------------------------------------------------------------------------


def header_frames(stream: int, block: bytes, flags: int = 0) -> bytes:
    """``block`` as HEADERS (with ``flags``) and CONTINUATION frames of the default size."""
    size = h2.MIN_FRAME_SIZE
    parts = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
    last = len(parts) - 1
    return b"".join(
        h2.frame(
            h2.CONTINUATION if i else h2.HEADERS,
            (0 if i else flags) | (h2.END_HEADERS if i == last else 0),
            stream,
            part,
        )
        for i, part in enumerate(parts)
    )


class RawClient:
    """An HTTP/2 client frame by frame: what a grpc.aio client never sends, or sends too fast
    to see (a small window, a broken header block, not HTTP/2 at all)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = Encoder()
        self.decoder = Decoder()

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        writer.write(h2.PREFACE + h2.settings_frame(settings or {}))
        kind, _, stream, _ = await client.frame(windows=True)  # the server's greeting, opening
        assert (kind, stream) == (h2.WINDOW_UPDATE, 0)  # the connection's window wide
        return client

    def headers(self, stream: int, extra: list[tuple[str, str]] | None = None) -> None:
        block = self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", raccoon.METHOD),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *(extra or []),
            ]
        )
        self.writer.write(header_frames(stream, block))

    def message(self, stream: int, message: bytes) -> None:
        data = length_prefixed(message)
        self.writer.write(h2.frame(h2.DATA, h2.END_STREAM, stream, data))

    async def ping(self) -> list[tuple[int, int, int, bytes]]:
        """Send a PING and read up to its ACK; returns the frames the server sent before it."""
        self.writer.write(h2.frame(h2.PING, 0, 0, b"12345678"))
        before = []
        while (got := await self.frame(windows=True)) != (h2.PING, h2.ACK, 0, b"12345678"):
            before.append(got)
        return before

    async def frame(self, windows: bool = False) -> tuple[int, int, int, bytes]:
        """The next frame other than the server's SETTINGS, its ACK and (unless ``windows``)
        WINDOW_UPDATE on the connection."""
        while True:
            head = await asyncio.wait_for(self.reader.readexactly(h2.FRAME_HEAD_SIZE), 10)
            high, low, kind, flags, stream = h2.FRAME_HEAD.unpack(head)
            payload = await asyncio.wait_for(self.reader.readexactly(high << 8 | low), 10)
            if kind == h2.SETTINGS or (kind == h2.WINDOW_UPDATE and not stream and not windows):
                continue
            if kind == h2.HEADERS:
                payload = repr(self.decoder.decode(payload, raw=True)).encode()
            return kind, flags, stream, payload

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def answered_on_a_new_channel(port: int, guid: str) -> None:
    """A well-formed call from a fresh grpc.aio channel is answered: the server still serves."""
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = parse_response(await send_event(channel)(request(guid), timeout=10))
        assert reply.data["req_guid"] == guid


async def raw_server(handle: Handle, max_message_bytes: int = 1 << 20) -> GrpcServer:
    server = GrpcServer(handle, "127.0.0.1", 0, max_message_bytes)
    await server.start()
    return server


def test_an_answer_waits_for_the_clients_flow_control_window() -> None:
    response = bytes(range(100))

    async def handle(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        return response

    async def main() -> None:
        server = await raw_server(handle)
        client = await RawClient.connect(server.port, {h2.INITIAL_WINDOW_SIZE: 10})
        try:
            client.headers(1)
            client.message(1, request())
            kind, flags, stream, block = await client.frame()
            assert (kind, stream) == (h2.HEADERS, 1) and not flags & h2.END_STREAM
            assert b"application/grpc" in block
            kind, _, stream, first = await client.frame()
            assert (kind, stream, len(first)) == (h2.DATA, 1, 10)  # what the window allows
            assert await client.ping() == []  # and nothing more
            client.writer.write(h2.window_update(1, 1000))
            kind, _, stream, rest = await client.frame()
            assert (kind, stream) == (h2.DATA, 1)
            assert first + rest == length_prefixed(response)
            kind, flags, stream, trailers = await client.frame()
            assert (kind, stream) == (h2.HEADERS, 1) and flags & h2.END_STREAM
            assert b"(b'grpc-status', b'0')" in trailers
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())


def test_metadata_over_the_limit_is_refused_and_the_connection_goes_on() -> None:
    rec = Recorder()

    async def main() -> None:
        server = await raw_server(rec)
        client = await RawClient.connect(server.port)
        try:
            client.headers(1, [("x-big", "v" * 20_000)])
            client.message(1, request("big"))
            kind, flags, stream, trailers = await client.frame()
            assert (kind, stream) == (h2.HEADERS, 1) and flags & h2.END_STREAM
            assert b"(b'grpc-status', b'8')" in trailers and b"metadata" in trailers
            client.headers(3)
            client.message(3, request("small"))
            kinds = [(await client.frame())[:3] for _ in range(3)]
            assert [k for k, _, _ in kinds] == [h2.HEADERS, h2.DATA, h2.HEADERS]
            assert {s for _, _, s in kinds} == {3}
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [request("small")]


def test_headers_that_are_not_utf8_are_unimplemented_and_the_connection_goes_on() -> None:
    rec = Recorder()
    good = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", raccoon.METHOD.encode())]
    good += [(b"content-type", b"application/grpc")]
    odd = {b":path": b"/\xff\xfe", b":method": b"P\xffST", b"grpc-encoding": b"\xffzip"}

    async def main() -> None:
        server = await raw_server(rec)
        client = await RawClient.connect(server.port)
        try:
            for stream, (name, value) in zip((1, 3, 5), odd.items(), strict=True):
                block = [(n, value if n == name else v) for n, v in good]
                if name not in dict(good):
                    block.append((name, value))
                client.writer.write(
                    h2.frame(h2.HEADERS, h2.END_HEADERS, stream, client.encoder.encode(block))
                )
                client.message(stream, request(f"odd-{stream}"))
                kind, flags, got, trailers = await client.frame()
                assert (kind, got) == (h2.HEADERS, stream)
                assert b"(b'grpc-status', b'12')" in trailers and b"\\\\xff" in trailers
                if not flags & h2.END_STREAM:  # not a POST: an HTTP answer, with a body
                    assert b"(b':status', b'405')" in trailers
                    kind, flags, got, text = await client.frame()
                    assert (kind, flags, got) == (h2.DATA, h2.END_STREAM, stream)
                    assert text.startswith(b"gRPC calls are POSTs, not P\\xffST")
            client.headers(7)
            client.message(7, request("fine"))
            kinds = [(await client.frame())[:3] for _ in range(3)]
            assert [k for k, _, _ in kinds] == [h2.HEADERS, h2.DATA, h2.HEADERS]
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [request("fine")]


@pytest.mark.parametrize(
    ("sent", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xff\xff\xff\xff"), 9),
        (h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 2, b"\x82"), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.PING, 0, 0, b"short"), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.DATA, 0, 7, b"\x00"), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.CONTINUATION, h2.END_HEADERS, 1, b"\x82"), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.SETTINGS, h2.ACK, 0, bytes(6)), h2.FRAME_SIZE_ERROR),
        (h2.PREFACE + h2.settings_frame({h2.ENABLE_PUSH: 2}), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.frame(h2.PRIORITY, 0, 0, bytes(5)), h2.PROTOCOL_ERROR),
        (h2.PREFACE + h2.window_update(9, 1), h2.PROTOCOL_ERROR),
    ],
    ids=[
        "http1",
        "bad-hpack",
        "even-stream",
        "short-ping",
        "data-on-idle",
        "stray-continuation",
        "settings-ack-with-payload",
        "enable-push-2",
        "priority-on-stream-0",
        "window-update-on-idle",
    ],
)
def test_a_broken_connection_gets_goaway_and_others_are_untouched(sent: bytes, code: int) -> None:
    rec = Recorder()

    async def main() -> None:
        server = await raw_server(rec)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(sent)
            broken = RawClient(reader, writer)
            kind, _, _, payload = await broken.frame()
            assert kind == h2.GOAWAY
            assert int.from_bytes(payload[4:8], "big") == code
            assert await asyncio.wait_for(reader.read(), 10) == b""  # then closed
            await broken.close()
            await answered_on_a_new_channel(server.port, "fine")
        finally:
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [request("fine")]


def test_requests_still_arriving_hold_the_connections_window() -> None:
    """Bytes of requests not yet whole are not given back to the client's connection window, so
    unfinished requests cannot make a connection hold more than its window."""
    rec = Recorder()
    mib = 1 << 20
    message = request("held", n=1, size=10 * mib - 100)

    async def main() -> None:
        server = await raw_server(rec, max_message_bytes=16 * mib)
        client = await RawClient.connect(server.port)
        try:
            data = length_prefixed(message)
            client.headers(1)
            size = h2.MIN_FRAME_SIZE
            parts = [data[i : i + size] for i in range(0, len(data), size)]
            for part in parts[:-1]:
                client.writer.write(h2.frame(h2.DATA, 0, 1, part))
            # over half the connection's window received, but no request whole: the stream's
            # own window is topped up, the connection's is not
            before = await client.ping()
            assert [(kind, stream) for kind, _, stream, _ in before] == [(h2.WINDOW_UPDATE, 1)]
            client.writer.write(h2.frame(h2.DATA, h2.END_STREAM, 1, parts[-1]))
            kind, _, stream, payload = await client.frame(windows=True)
            assert (kind, stream) == (h2.WINDOW_UPDATE, 0)
            assert h2.u32(payload) == len(data)
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [message]


def test_mutated_http2_sessions_never_break_the_server(caplog: pytest.LogCaptureFixture) -> None:
    """300 byte-level mutations of a client's whole session (preface, SETTINGS, two calls, a
    PING, a WINDOW_UPDATE), each on its own connection: the server never fails inside (no
    error logged), and a well-formed call is still answered afterwards."""
    encoder = Encoder()
    head = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", raccoon.METHOD),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("x-user-id", "u"),
    ]
    message = request("fz")
    data = length_prefixed(message)
    session = (
        h2.PREFACE
        + h2.settings_frame({h2.INITIAL_WINDOW_SIZE: 100, h2.MAX_FRAME_SIZE: 16_384})
        + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, encoder.encode(head))
        + h2.frame(h2.DATA, 0, 1, data[:20])
        + h2.frame(h2.DATA, h2.END_STREAM, 1, data[20:])
        + h2.frame(h2.PING, 0, 0, b"abcdefgh")
        + h2.frame(
            h2.HEADERS,
            h2.END_HEADERS | h2.END_STREAM | h2.PADDED,
            3,
            b"\x02" + encoder.encode(head) + b"\x00\x00",
        )
        + h2.window_update(0, 1000)
    )
    rng = random.Random(14)

    def mutate(raw: bytes) -> bytes:
        out = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(out))
            kind = rng.random()
            if kind < 0.5:
                out[at] = rng.randrange(256)
            elif kind < 0.75:
                del out[at : at + rng.randint(1, 16)]
            else:
                out[at:at] = rng.randbytes(rng.randint(1, 16))
        return bytes(out[: rng.randint(len(out) // 2, len(out))] if rng.random() < 0.2 else out)

    rec = Recorder()

    async def main() -> None:
        server = await raw_server(rec, max_message_bytes=4096)
        try:
            for _ in range(300):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(mutate(session))
                writer.write_eof()
                # the server answers what it can, and closes once the client has closed
                await asyncio.wait_for(reader.read(), 10)
                writer.close()
                await writer.wait_closed()
            await answered_on_a_new_channel(server.port, "after")
        finally:
            await server.stop(1)

    with caplog.at_level(logging.INFO, logger="headwater.collector.grpc_server"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0].getMessage()
    closed = [r for r in caplog.records if "closed:" in r.getMessage()]
    assert len(closed) > 100  # most mutations broke the connection, and each was told why


GOOD_REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", raccoon.METHOD),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def _without(name: str) -> list[tuple[str, str]]:
    return [(n, v) for n, v in GOOD_REQUEST if n != name]


def _with(name: str, value: str, at: int) -> list[tuple[str, str]]:
    return [*GOOD_REQUEST[:at], (name, value), *GOOD_REQUEST[at:]]


MALFORMED_REQUESTS = {  # RFC 9113 §8.2-8.3: each a stream error of type PROTOCOL_ERROR
    "upper-case-name": _with("X-Trace", "1", 6),
    "unknown-pseudo-header": _with(":foo", "x", 0),
    "response-pseudo-header": _with(":status", "200", 0),
    "pseudo-after-regular-field": _with(":authority", "x", 6)[:3] + _with(":authority", "x", 6)[4:],
    "connection-specific-field": _with("connection", "keep-alive", 6),
    "te-other-than-trailers": [*_without("te"), ("te", "trailers, deflate")],
    "empty-path": [(n, "" if n == ":path" else v) for n, v in GOOD_REQUEST],
    "no-method": _without(":method"),
    "no-scheme": _without(":scheme"),
    "no-path": _without(":path"),
    "method-twice": _with(":method", "POST", 1),
    "scheme-twice": _with(":scheme", "http", 2),
    "path-twice": _with(":path", raccoon.METHOD, 3),
}


def _reset_then_served(
    send: Callable[[RawClient], bytes], code: int, *, closed_window_update: bool = False
) -> None:
    """What ``send`` writes resets stream 1 with ``code``; a good call on stream 3 is answered
    afterwards (and, with ``closed_window_update``, a WINDOW_UPDATE of 0 on it once closed is
    a stream error too, RFC 9113 §6.9); the handler sees only the good call."""
    rec = Recorder()

    async def main() -> None:
        server = await raw_server(rec)
        client = await RawClient.connect(server.port)
        try:
            client.writer.write(send(client))
            assert await client.frame() == _reset(1, code)
            client.headers(3)
            client.message(3, request("fine"))
            kinds = [(await client.frame())[:3] for _ in range(3)]
            assert kinds == [(h2.HEADERS, h2.END_HEADERS, 3), (h2.DATA, 0, 3), kinds[2]]
            assert kinds[2][0] == h2.HEADERS and kinds[2][1] & h2.END_STREAM
            if closed_window_update:
                client.writer.write(h2.window_update(3, 0))
                assert await client.frame() == _reset(3, h2.PROTOCOL_ERROR)
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [request("fine")]


@pytest.mark.parametrize("block", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS.keys())
def test_a_malformed_request_is_reset_and_the_connection_goes_on(
    block: list[tuple[str, str]],
) -> None:
    _reset_then_served(
        lambda c: (
            h2.frame(h2.HEADERS, h2.END_HEADERS, 1, c.encoder.encode(block))
            + h2.frame(h2.DATA, h2.END_STREAM, 1, length_prefixed(request("malformed")))
        ),
        h2.PROTOCOL_ERROR,
    )


def _priority(depends_on: int) -> bytes:
    return depends_on.to_bytes(4, "big") + b"\x10"  # not exclusive, weight 17


def _reset(stream: int, code: int) -> tuple[int, int, int, bytes]:
    return (h2.RST_STREAM, 0, stream, code.to_bytes(4, "big"))


ENDS = h2.END_HEADERS | h2.END_STREAM


STREAM_ERRORS = {  # (what the client sends on stream 1 or about it, the RST_STREAM code)
    "priority-of-4-bytes": (lambda c: h2.frame(h2.PRIORITY, 0, 1, bytes(4)), h2.FRAME_SIZE_ERROR),
    "priority-on-itself": (
        lambda c: h2.frame(h2.PRIORITY, 0, 1, _priority(1)),
        h2.PROTOCOL_ERROR,
    ),
    "headers-depending-on-themselves": (
        lambda c: h2.frame(
            h2.HEADERS,
            h2.END_HEADERS | h2.PRIORITY_FLAG,
            1,
            _priority(1) + c.encoder.encode(GOOD_REQUEST),
        ),
        h2.PROTOCOL_ERROR,
    ),
    "trailers-with-a-pseudo-header": (
        lambda c: (
            h2.frame(h2.HEADERS, h2.END_HEADERS, 1, c.encoder.encode(GOOD_REQUEST))
            + h2.frame(
                h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, 1, c.encoder.encode([(":path", "/")])
            )
        ),
        h2.PROTOCOL_ERROR,
    ),
}


@pytest.mark.parametrize(("send", "code"), STREAM_ERRORS.values(), ids=STREAM_ERRORS.keys())
def test_a_stream_error_resets_the_stream_and_the_connection_goes_on(
    send: Callable[[RawClient], bytes], code: int
) -> None:
    _reset_then_served(send, code, closed_window_update=True)


def test_a_request_never_finished_is_answered_at_its_deadline_then_the_idle_connection_ends() -> (
    None
):
    """A stream whose request never comes whole is answered DEADLINE_EXCEEDED (and reset) at
    the request timeout; a connection that then sends nothing is closed at the idle timeout."""
    rec = Recorder()

    async def main() -> None:
        server = GrpcServer(
            rec, "127.0.0.1", 0, 1 << 20, request_timeout_s=0.3, idle_timeout_s=1.0, tick_s=0.05
        )
        await server.start()
        client = await RawClient.connect(server.port)
        try:
            client.headers(1)  # and never its DATA
            kind, flags, stream, trailers = await client.frame()
            assert (kind, stream) == (h2.HEADERS, 1) and flags & h2.END_STREAM
            assert b"(b'grpc-status', b'4')" in trailers and b"0.3 s" in trailers
            assert await client.frame() == _reset(1, h2.NO_ERROR)
            kind, _, _, payload = await client.frame()
            assert (kind, h2.u32(payload[4:8])) == (h2.GOAWAY, h2.NO_ERROR)
            assert b"nothing received for 1 s" in payload
            assert await asyncio.wait_for(client.reader.read(), 10) == b""
            assert not server.connections
            await answered_on_a_new_channel(server.port, "fine")
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert [raw for raw, _, _ in rec.calls] == [request("fine")]


def test_a_client_that_never_opens_its_window_holds_bounded_answers() -> None:
    """A client that lets the server send nothing (a stream window of 0) gets its calls handled
    but their answers wait, up to SETTINGS_MAX_CONCURRENT_STREAMS calls: later ones are refused
    with REFUSED_STREAM, so what waits is bounded; the idle timeout then ends the connection."""
    rec = Recorder()
    calls = MAX_STREAMS + 50

    async def main() -> None:
        server = GrpcServer(rec, "127.0.0.1", 0, 1 << 20, idle_timeout_s=1.0, tick_s=0.05)
        await server.start()
        client = await RawClient.connect(server.port, {h2.INITIAL_WINDOW_SIZE: 0})
        try:
            for i in range(calls):
                client.headers(2 * i + 1)
                client.message(2 * i + 1, request(f"w-{i}"))
            refused, heads = set(), 0
            while len(refused) < calls - MAX_STREAMS or heads < MAX_STREAMS:
                kind, _, stream, payload = await client.frame()
                if kind == h2.RST_STREAM:
                    assert payload == h2.REFUSED_STREAM.to_bytes(4, "big")
                    refused.add(stream)
                else:
                    assert kind == h2.HEADERS  # the answers' heads, never their DATA
                    heads += 1
            assert min(refused) == 2 * MAX_STREAMS + 1
            [connection] = server.connections
            waiting = sum(len(s.pending) for s in connection._streams.values())
            assert waiting <= MAX_STREAMS * 64  # each answer a few dozen bytes
            kind, _, _, payload = await client.frame()  # nothing sent: idle
            assert (kind, h2.u32(payload[4:8])) == (h2.GOAWAY, h2.NO_ERROR)
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert len(rec.calls) == MAX_STREAMS


def test_a_connection_has_at_most_max_handling_calls_in_the_handler_and_others_go_first() -> None:
    """A client that sends many calls at once gets them handled MAX_HANDLING at a time, the rest
    read once calls are answered; a call on another connection is handled in between, not after
    all of them; in the end every call is answered."""
    calls = 3 * MAX_HANDLING
    release = asyncio.Event()
    inside: list[str] = []
    most = 0

    async def handle(raw: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        nonlocal most
        intake = raccoon.decode_request(raw, LIMITS)
        guid = intake.request_id or ""
        inside.append(guid)
        most = max(most, len(inside))
        if guid.startswith("many-"):
            await release.wait()
        inside.remove(guid)
        return raccoon.ok_response_bytes(guid)

    async def main() -> None:
        server = await raw_server(handle)
        client = await RawClient.connect(server.port)
        try:
            for i in range(calls):
                client.headers(2 * i + 1)
                client.message(2 * i + 1, request(f"many-{i}"))
            await client.writer.drain()
            await until(lambda: len(inside) == MAX_HANDLING, "the first calls in the handler")
            await answered_on_a_new_channel(server.port, "other")  # while 64 wait
            release.set()
            answered = set()
            while len(answered) < calls:
                kind, flags, stream, _ = await client.frame()
                if kind == h2.HEADERS and flags & h2.END_STREAM:
                    answered.add(stream)
            assert answered == {2 * i + 1 for i in range(calls)}
        finally:
            await client.close()
            await server.stop(1)

    asyncio.run(main())
    assert most == MAX_HANDLING + 1  # the connection's calls, and the other one beside them
