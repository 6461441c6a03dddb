"""An intake worker's link to the process that holds the log (``wire`` frames, asyncio side).

Appends are sent at the end of the loop's turn that made them and answered once durable; the
requests of a turn that each append one batch to the same topic and partition go as one merged
batch (so the log frames, writes and answers one batch for them, not one per request); the
answers of a group commit arrive together, so one read wakes every request they complete. The
link also counts WebSocket connections against the shared limits, asks for readiness, topic
sizes and the merged metrics, and answers the host's requests for this worker's metric
snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from headwater.bus.embedded import format as fmt
from headwater.bus.errors import BusError, BusUnavailable, InvalidArgument
from headwater.bus.room import Room
from headwater.collector import wire
from headwater.collector.batch import EmbeddedEncoding
from headwater.collector.memory import trim_heap
from headwater.collector.ring import Ring

log = logging.getLogger(__name__)


DEFAULT_MAX_PENDING = 32 << 20
ROOM_WAIT_S = 10.0
RELEASE_EVERY_S = 1.0
FLUSH_PARTS = 64  # frame parts queued that are sent at once (about 16 appends)
MERGE_BYTES = 256 << 10  # a turn's appends to one topic and partition merge up to this size


_Release = Callable[[], None] | None


class _Answer(Protocol):
    """What takes a request's answer: its future, or a merged group's members."""

    def done(self) -> bool: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exception: BaseException) -> None: ...


class _Group:
    """A turn's single-batch appends to one topic and partition: sent as one merged batch,
    whose answer each member gets at its own records' start."""

    __slots__ = ("members", "partition", "size", "topic")

    def __init__(self, topic: str, partition: int | None) -> None:
        self.topic = topic
        self.partition = partition
        self.members: list[tuple[fmt.EncodedBatch, asyncio.Future[list[int]]]] = []
        self.size = 0

    def add(self, batch: fmt.EncodedBatch, future: asyncio.Future[list[int]]) -> None:
        self.members.append((batch, future))
        self.size += len(batch.body)

    def done(self) -> bool:
        return all(f.done() for _, f in self.members)

    def set_result(self, bases: list[int]) -> None:
        (base,) = bases  # each member's records follow those of the members before it
        for batch, future in self.members:
            if not future.done():  # (cancelled by its caller)
                future.set_result([base])
            base += batch.count

    def set_exception(self, exception: BaseException) -> None:
        for _, future in self.members:
            if not future.done():
                future.set_exception(exception)


class LinkClosed(BusUnavailable):
    """The process that holds the log is gone."""


class Link(EmbeddedEncoding, asyncio.Protocol):
    def __init__(
        self,
        snapshot: Callable[[], list[Any]],
        ring: Ring | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self._snapshot = snapshot
        self._ring = ring
        self.max_pending_bytes = max_pending_bytes
        self._room = Room(max_pending_bytes)  # bytes appended and not answered, in turn
        self._transport: asyncio.Transport | None = None
        self._frames = wire.Frames()
        self._out: list[bytes] = []  # frames to send at the end of this turn of the loop
        self._flushing = False
        # this turn's single-batch appends by (topic, partition), merged into one batch each
        # when the turn's frames are sent (``_send_merged``)
        self._merging: dict[tuple[str, int | None], _Group] = {}
        # id -> (the answer's future, how to read the answer: a value, or raise, and what to
        # release once the log has answered: an append's ring regions)
        self._waiting: dict[int, tuple[_Answer, Callable[[memoryview], Any], _Release]]
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
        groups, self._merging = self._merging, {}
        for group in groups.values():
            self._room.release(group.size)
            group.set_exception(LinkClosed("the process that holds the log has gone"))
        self._room.fail(LinkClosed("the process that holds the log has gone"))
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
        else:
            self._flush_later()

    def _flush_later(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flushing = False
        self._send_merged()
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
        answer: _Answer | None = None,
    ) -> asyncio.Future[Any]:
        self._next = (self._next + 1) & 0xFFFFFFFF
        ident = self._next
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            self._send(data(ident))
        except LinkClosed as e:
            if answer is not None:
                answer.set_exception(e)
            raise
        self._waiting[ident] = (answer or future, read, release)
        return future

    def append(
        self, batches: Sequence[tuple[str, int | None, fmt.EncodedBatch]]
    ) -> asyncio.Future[list[int]]:
        """Queue encoded batches (all or none) to be sent at the end of this turn of the loop,
        their bodies through the shared ring where they fit; their base offsets once durable.

        The appends of one turn with a single batch for the same topic and partition (a
        request's events that all go to one topic: the common case) are merged into one
        batch (``fmt.merge``, up to ``MERGE_BYTES``): the log then frames, writes and answers
        one batch for them, and each append's base offset is where its records start in it.
        An append of several batches goes as it is, after the merged batches queued before it
        (so that one connection's requests keep their order in each partition).

        The bodies' ring regions are freed when the log answers (or the link ends), not when
        the future is done: a caller that cancels its future (a request cancelled while it
        waits) must not let the ring reuse bytes the log has yet to write."""
        if self._transport is None:
            raise LinkClosed("the process that holds the log has gone")
        size = sum(len(b.body) for _, _, b in batches)
        self._room.take(size)
        if len(batches) == 1 and batches[0][2].last_offset_delta == batches[0][2].count - 1:
            topic, partition, batch = batches[0]
            future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
            group = self._merging.get((topic, partition))
            if group is None:
                group = self._merging[(topic, partition)] = _Group(topic, partition)
            group.add(batch, future)
            if group.size >= MERGE_BYTES:  # enough to keep the log busy: send it now
                with contextlib.suppress(LinkClosed):  # (its futures have failed)
                    self._group_frame(self._merging.pop((topic, partition)))
                    self._flush()
            else:
                self._flush_later()
            return future
        self._send_merged()  # what this turn merged so far goes first
        return self._frame(batches, size)

    def _frame(
        self,
        batches: Sequence[tuple[str, int | None, fmt.EncodedBatch]],
        size: int,
        answer: _Answer | None = None,
        at: list[int | None] | None = None,
    ) -> asyncio.Future[list[int]]:
        """Send one APPEND frame of ``batches`` (``size`` bytes of bodies, already counted in
        ``pending_bytes``); ``answer`` takes its result instead of the future returned. ``at``:
        where the bodies already are in the ring (else they are put there, where they fit)."""
        ring = self._ring
        if at is None:
            at = [None if ring is None else ring.put(b.body) for _, _, b in batches]
        used = [a for a in at if a is not None]

        def release() -> None:
            for a in used:
                ring.free(a)  # type: ignore[union-attr]
            self._room.release(size)

        try:
            return self._request(
                lambda ident: wire.append_frame(ident, batches, at), _bases, release, answer
            )
        except BaseException:
            release()
            raise

    def _group_frame(self, group: _Group) -> None:
        """Queue the frame of a group: its one batch as it is, or its batches merged."""
        if len(group.members) == 1:
            batch, future = group.members[0]
            self._frame([(group.topic, group.partition, batch)], group.size, future)
        else:  # merged straight into the ring where it fits (one copy of the bodies)
            batches = [b for b, _ in group.members]
            at = None if self._ring is None else self._ring.take(group.size)
            if at is None:
                merged = fmt.merge(batches)
            else:
                merged = fmt.merge_into(batches, self._ring.view[at : at + group.size])  # type: ignore[union-attr]
            self._frame([(group.topic, group.partition, merged)], group.size, group, [at])

    def _send_merged(self) -> None:
        """Queue the frames of this turn's merged appends (a lost link fails their futures)."""
        if self._merging:
            groups, self._merging = self._merging, {}
            for group in groups.values():
                with contextlib.suppress(LinkClosed):
                    self._group_frame(group)

    @property
    def pending_bytes(self) -> int:
        """Bytes appended and not answered yet."""
        return self._room.used

    async def room(self, nbytes: int) -> None:
        """Wait (in turn) until the bytes on their way to the log leave room for ``nbytes``
        more: the log's pace holds requests here, so a client's next request waits for this
        one's ack instead of being refused. Past ``ROOM_WAIT_S``: ``BusUnavailable``."""
        if not await self._room.wait(nbytes, ROOM_WAIT_S):
            raise BusUnavailable(
                f"this intake worker has {self.pending_bytes} bytes on their way to the log "
                f"(limit {self.max_pending_bytes}) and no room came within {ROOM_WAIT_S:.0f} s; "
                "retry shortly"
            )

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
