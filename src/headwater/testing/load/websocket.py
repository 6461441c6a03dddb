"""A WebSocket load client just big enough to load the collector: the handshake, pre-built
request frames out (only each request's ``req_guid`` masked and spliced in), the server's frames
parsed: binary frames are SendEventResponses matched to their request by req_guid, pings
answered, a close noted."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from headwater.testing.clients import OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, encode_frame
from headwater.testing.load.requests import GUID_LEN, USER_AGENT, Guids, Stats, response_problem

EVENTS_PATH = "/api/v1/events"


class RequestFrames:
    """Binary frames of the template request, masked once; per request only the 36 bytes of its
    req_guid are masked and spliced in. One masking key per process (a server cannot tell)."""

    def __init__(self, template: bytes, mask: bytes) -> None:
        self.mask = mask
        whole = encode_frame(OP_BINARY, template, key=mask)
        start = len(whole) - len(template)  # the payload's offset in the frame
        self.prefix = whole[: start + 2]
        self.tail = whole[start + 2 + GUID_LEN :]
        self.guid_key = int.from_bytes((mask * 11)[2 : 2 + GUID_LEN], "big")

    def frame(self, guid: bytes) -> bytes:
        masked = (int.from_bytes(guid, "big") ^ self.guid_key).to_bytes(GUID_LEN, "big")
        return b"".join((self.prefix, masked, self.tail))


@dataclass
class WsLoad:
    """What the connections of one generator process share."""

    host: str
    port: int
    tag: str
    frames: RequestFrames
    in_flight: int = 4  # requests a connection may have sent and not yet seen acked
    stats: Stats = field(default_factory=Stats)
    closed_loop: bool = True
    sending: bool = False


class WsClient(asyncio.Protocol):
    def __init__(self, load: WsLoad, index: int, identity: str) -> None:
        self.load = load
        self.guids = Guids(f"{load.tag}-{index:06d}-")
        key = base64.b64encode(os.urandom(16)).decode()
        self.handshake = (
            f"GET {EVENTS_PATH} HTTP/1.1\r\nHost: {load.host}:{load.port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Key: {key}\r\nX-User-ID: {identity}\r\nUser-Agent: {USER_AGENT}\r\n\r\n"
        ).encode()
        loop = asyncio.get_running_loop()
        self.upgraded: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[bytes, float] = {}
        self.close_code: int | None = None
        self.acked: asyncio.Event | None = None  # set on each ack (idle connections use it)
        self._buffer = bytearray()
        self._open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.handshake)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError(f"lost before the upgrade: {exc}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def send_request(self) -> None:
        assert self.transport is not None
        guid = self.guids.next()
        self.pending[guid] = time.perf_counter()
        self.transport.write(self.load.frames.frame(guid))
        self.load.stats.sent += 1

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._open and not self._upgrade(buffer):
            return
        pos, n = 0, len(buffer)
        while n - pos >= 2:
            length, head = buffer[pos + 1] & 0x7F, 2
            if length >= 126:
                head = 4 if length == 126 else 10
                if n - pos < head:
                    break
                length = int.from_bytes(buffer[pos + 2 : pos + head], "big")
            end = pos + head + length
            if end > n:
                break
            opcode = buffer[pos] & 0x0F
            payload = bytes(buffer[pos + head : end])
            pos = end
            if opcode == OP_BINARY:
                self._response(payload)
            elif opcode == OP_PING:  # answered with a pong carrying the same data
                assert self.transport is not None
                self.transport.write(encode_frame(OP_PONG, payload, key=self.load.frames.mask))
            elif opcode == OP_CLOSE:
                self.close_code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
                self.close()
        if pos:
            del buffer[:pos]

    def _upgrade(self, buffer: bytearray) -> bool:
        """Take the handshake's answer off ``buffer``; True once upgraded."""
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        status = bytes(buffer[: buffer.find(b"\r\n")])
        if not status.startswith(b"HTTP/1.1 101"):
            self.upgraded.set_exception(ConnectionError(status.decode(errors="replace")))
            assert self.transport is not None
            self.transport.close()
            return False
        del buffer[: end + 4]
        self._open = True
        self.upgraded.set_result(None)
        return True

    def _response(self, payload: bytes) -> None:
        stats = self.load.stats
        guid, problem = response_problem(payload)
        sent_at = self.pending.pop(guid, None) if guid is not None else None
        if sent_at is None:
            stats.unmatched += 1
            if not problem:
                problem = "an ack for a request this connection did not send"
        if problem:
            stats.error(problem)
        elif sent_at is not None:
            stats.ack(sent_at)
        if self.acked is not None:
            self.acked.set()
        load = self.load
        if load.closed_loop and load.sending and len(self.pending) < load.in_flight:
            self.send_request()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            code = (1000).to_bytes(2, "big")
            self.transport.write(encode_frame(OP_CLOSE, code, key=self.load.frames.mask))
            self.transport.close()


async def open_websockets(
    load: WsLoad, count: int, source: str | None, deadline_s: float, parallel: int = 200
) -> tuple[list[WsClient], list[str]]:
    """Open ``count`` upgraded connections, ``parallel`` handshakes at a time, each with its own
    identity; from ``source`` (a 127.0.0.x address) when given."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(parallel)
    opened: list[WsClient] = []
    errors: list[str] = []
    local = (source, 0) if source else None

    async def one(i: int) -> None:
        async with gate:
            try:
                _, client = await loop.create_connection(
                    lambda: WsClient(load, i, f"load-{load.tag}-{i}"),
                    load.host,
                    load.port,
                    local_addr=local,
                )
                await asyncio.wait_for(client.upgraded, 30)
                opened.append(client)
            except (TimeoutError, OSError, ConnectionError) as e:
                errors.append(f"{type(e).__name__}: {e}")

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), deadline_s)
    return opened, errors


async def pace(load: WsLoad, clients: Sequence[WsClient], requests_per_s: float) -> None:
    """Send ``requests_per_s`` round-robin over the connections, skipping full ones; when every
    connection is full the collector is behind, and the debt is dropped (counted)."""
    start, sent, i, n = time.perf_counter(), 0, 0, len(clients)
    while load.sending:
        due = int((time.perf_counter() - start) * requests_per_s) - sent
        full = 0
        while due > 0 and full < n:
            client = clients[i % n]
            i += 1
            if len(client.pending) < load.in_flight and not client.lost.done():
                client.send_request()
                sent, due, full = sent + 1, due - 1, 0
            else:
                full += 1
        if full >= n:
            start, sent = time.perf_counter(), 0
        await asyncio.sleep(0.001)
