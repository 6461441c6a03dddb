"""An intake worker's link to the process that holds the log (``wire`` frames, asyncio side).

Appends are written to the socket as they come and answered once durable; the answers of a
group commit arrive together, so one read wakes every request they complete. The link also
counts WebSocket connections against the shared limits, asks for readiness, topic sizes and the
merged metrics, and answers the host's requests for this worker's metric snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from headwater.bus.embedded import format as fmt
from headwater.bus.errors import BusError, BusUnavailable, InvalidArgument
from headwater.collector import wire
from headwater.collector.memory import trim_heap
from headwater.collector.ring import Ring

log = logging.getLogger(__name__)


DEFAULT_MAX_PENDING = 32 << 20
ROOM_WAIT_S = 10.0
RELEASE_EVERY_S = 1.0
FLUSH_PARTS = 64  # frame parts queued that are sent at once (about 16 appends)


_Release = Callable[[], None] | None


class LinkClosed(BusUnavailable):
    """The process that holds the log is gone."""


class Link(asyncio.Protocol):
    def __init__(
        self,
        snapshot: Callable[[], list[Any]],
        ring: Ring | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self._snapshot = snapshot
        self._ring = ring
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # appended, not answered yet
        self._promised = 0  # granted by ``room``, not appended yet
        self._room_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._transport: asyncio.Transport | None = None
        self._frames = wire.Frames()
        self._out: list[bytes] = []  # frames to send at the end of this turn of the loop
        self._flushing = False
        # id -> (the answer's future, how to read the answer: a value, or raise, and what to
        # release once the log has answered: an append's ring regions)
        self._waiting: dict[int, tuple[asyncio.Future[Any], Callable[[memoryview], Any], _Release]]
        self._waiting = {}
        self._next = 0
        self._topics: dict[str, int] = {}
        self.notice: dict[str, Any] = {}
        self.closed = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        sock: socket.socket,
        snapshot: Callable[[], list[Any]],
        ring: Ring | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING,
    ) -> Link:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(
            lambda: cls(snapshot, ring, max_pending_bytes), sock=sock
        )
        return link

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._ring is not None:
            self._release_later()

    def _release_later(self) -> None:
        """Every ``RELEASE_EVERY_S``: give the ring's pages back when it is idle."""
        if self._transport is None or self._ring is None:
            return
        if self._ring.release_if_idle():
            trim_heap()
        asyncio.get_running_loop().call_later(RELEASE_EVERY_S, self._release_later)

    def data_received(self, data: bytes) -> None:
        for kind, ident, payload in self._frames.feed(data):
            if kind == wire.RESULT:
                waiting = self._waiting.pop(ident, None)
                if waiting is None:
                    continue
                future, read, release = waiting
                if release is not None:
                    release()  # the log has written the bodies: their ring regions are free
                if future.done():  # (cancelled by its caller: the answer is not wanted)
                    continue
                try:
                    future.set_result(read(payload))
                except Exception as e:
                    future.set_exception(e)
            elif kind == wire.ASK:
                self._send(wire.json_frame(wire.SNAPSHOT, ident, self._snapshot()))
            elif kind == wire.NOTICE:
                self.notice.update(json.loads(bytes(payload)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for future, _, release in self._waiting.values():
            if release is not None:
                release()  # nobody reads the ring any more
            if not future.done():
                future.set_exception(LinkClosed("the process that holds the log has gone"))
        self._waiting.clear()
        for _, waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_exception(LinkClosed("the process that holds the log has gone"))
        self.closed.set()

    # -- requests ---------------------------------------------------------------------------
    def _send(self, data: bytes | Sequence[bytes]) -> None:
        """Queue frames to send; everything queued in one turn of the event loop goes in one
        write (the requests a round of answers wakes append together)."""
        if self._transport is None:
            raise LinkClosed("the process that holds the log has gone")
        if isinstance(data, bytes):
            self._out.append(data)
        else:
            self._out += data
        if len(self._out) >= FLUSH_PARTS:  # enough to keep the log busy: send now
            self._flush()
        elif not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flushing = False
        self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._transport is not None and out:
            self._transport.write(b"".join(out))

    def _request(
        self,
        data: Callable[[int], bytes | Sequence[bytes]],
        read: Callable[[memoryview], Any],
        release: _Release = None,
    ) -> asyncio.Future[Any]:
        self._next = (self._next + 1) & 0xFFFFFFFF
        ident = self._next
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(data(ident))
        self._waiting[ident] = (future, read, release)
        return future

    def append(
        self, batches: Sequence[tuple[str, int | None, fmt.EncodedBatch]]
    ) -> asyncio.Future[list[int]]:
        """Send encoded batches now (queued all or none), their bodies through the shared
        ring where they fit; their base offsets once durable.

        The bodies' ring regions are freed when the log answers (or the link ends), not when
        the future is done: a caller that cancels its future (a request cancelled while it
        waits) must not let the ring reuse bytes the log has yet to write."""
        size = sum(len(b.body) for _, _, b in batches)
        self._promised = max(0, self._promised - size)
        ring = self._ring
        at = [None if ring is None else ring.put(b.body) for _, _, b in batches]
        used = [a for a in at if a is not None]

        def release() -> None:
            self.pending_bytes -= size
            for a in used:
                ring.free(a)  # type: ignore[union-attr]
            self._grant()

        self.pending_bytes += size
        try:
            return self._request(
                lambda ident: wire.append_frame(ident, batches, at), _bases, release
            )
        except BaseException:
            release()
            raise

    def _fits(self, nbytes: int) -> bool:
        queued = self.pending_bytes + self._promised
        return queued == 0 or queued + nbytes <= self.max_pending_bytes

    async def room(self, nbytes: int) -> None:
        """Wait (in turn) until the bytes on their way to the log leave room for ``nbytes``
        more: the log's pace holds requests here, so a client's next request waits for this
        one's ack instead of being refused. Past ``ROOM_WAIT_S``: ``BusUnavailable``."""
        if not self._room_waiters and self._fits(nbytes):
            self._promised += nbytes
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._room_waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), ROOM_WAIT_S)
        except TimeoutError:
            if waiter.done():  # granted as the wait ended: hand the room back
                self._promised = max(0, self._promised - nbytes)
                self._grant()
            raise BusUnavailable(
                f"this intake worker has {self.pending_bytes} bytes on their way to the log "
                f"(limit {self.max_pending_bytes}) and no room came within {ROOM_WAIT_S:.0f} s; "
                "retry shortly"
            ) from None
        finally:
            with contextlib.suppress(ValueError):
                self._room_waiters.remove(entry)

    def _grant(self) -> None:
        waiters = self._room_waiters
        while waiters:
            nbytes, waiter = waiters[0]
            if waiter.done():
                waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            waiters.popleft()
            self._promised += nbytes
            waiter.set_result(None)

    async def call(self, op: str, **args: Any) -> Any:
        return await self._request(
            lambda ident: wire.json_frame(wire.CALL, ident, {"op": op, **args}), _answer
        )

    async def partitions(self, topic: str) -> int:
        known = self._topics.get(topic)
        if known is None:
            known = self._topics[topic] = int(await self.call("topic", name=topic))
        return known

    async def open_connection(self, identity: str) -> None:
        """Count a WebSocket connection, or raise ``Rejected`` (the shared limits)."""
        await self._request(
            lambda ident: wire.frame(wire.CONN_OPEN, ident, identity.encode()), _admitted
        )

    def ready(self) -> None:
        """Tell the host this worker serves its ports."""
        self._send(wire.frame(wire.READY, 0))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._ring is not None and not self._waiting:
            self._ring.close()

    def close_connection(self, identity: str) -> None:
        # (a closed link: the host released every connection of this worker when it went)
        with contextlib.suppress(LinkClosed):
            self._send(wire.frame(wire.CONN_CLOSE, 0, identity.encode()))


def _bases(payload: memoryview) -> list[int]:
    status = payload[0]
    if status == wire.OK:
        return wire.read_bases(payload)
    message = bytes(payload[1:]).decode()
    if status == wire.ERROR_INVALID:
        raise InvalidArgument(message)
    raise BusUnavailable(message)


def _answer(payload: memoryview) -> Any:
    if payload[0] != wire.OK:
        raise BusError(bytes(payload[1:]).decode())
    return json.loads(bytes(payload[1:]))


def _admitted(payload: memoryview) -> None:
    if payload[0] != wire.OK:
        raise wire.read_refusal(payload)
