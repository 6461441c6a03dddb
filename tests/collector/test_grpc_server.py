"""The gRPC intake over real loopback sockets, with a real grpc.aio client and no stubs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import pytest
from grpc import aio

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Code, Rejected, unavailable
from headwater.collector.grpc_server import GrpcServer, peer_ip
from headwater.collector.protocols import raccoon

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


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:%5B::1%5D:5555", "::1"),
        ("ipv6:[fe80::1%25eth0]:80", "fe80::1%eth0"),
        ("unix:/tmp/socket", ""),
        ("", ""),
    ],
)
def test_peer_ip(peer: str, ip: str) -> None:
    assert peer_ip(peer) == ip
