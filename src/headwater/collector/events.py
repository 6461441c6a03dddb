"""What every intake produces: events with their bytes as sent, and the request's context.

An intake (Raccoon, Segment, Jitsu, OTLP) decodes a request into ``Intake``: the events, each
with its type and the exact bytes to store, plus what it learned of the request. The publisher
turns them into bus messages whose headers carry the context (``headwater.bus.context``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from headwater.bus import context
from headwater.bus.headers import PackedHeaders, pack_header
from headwater.bus.headers import pack as pack_headers
from headwater.bus.records import Header, Message


class EventIn(NamedTuple):
    """One event: its type, the bytes to store exactly, and optionally a partition key."""

    type: str
    value: bytes
    content_type: str
    key: bytes | None = None


# EventIn's fields by position, for C-level passes over a request's events (map, all, sum)
event_type = itemgetter(0)
event_value = itemgetter(1)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the collector knows about the request that carried some events."""

    protocol: str
    source: str
    request_id: str
    received_ms: int
    client_ip: str = ""
    user_agent: str = ""

    def shared_headers(self) -> tuple[Header, ...]:
        """The headers every event of the request carries."""
        received = datetime.fromtimestamp(self.received_ms / 1000, UTC)
        headers: list[Header] = [
            (context.SOURCE, self.source.encode()),
            (context.REQUEST_ID, self.request_id.encode()),
            (context.RECEIVED_AT, received.isoformat(timespec="milliseconds")[:-6].encode() + b"Z"),
            (context.PROTOCOL, self.protocol.encode()),
        ]
        if self.client_ip:
            headers.append((context.CLIENT_IP, self.client_ip.encode()))
        if self.user_agent:
            headers.append((context.USER_AGENT, self.user_agent.encode()))
        return tuple(headers)


@dataclass(slots=True)
class Intake:
    """A decoded request: its events and the request id the client gave (if any)."""

    events: list[EventIn]
    request_id: str | None = None
    meta: dict[str, str] = field(default_factory=dict)


def to_messages(
    events: Sequence[EventIn], ctx: RequestContext, *, ids: Sequence[bytes] | None = None
) -> list[Message]:
    """Bus messages for ``events``: values untouched, context in headers, one UUIDv7 each
    (``ids``, when given, are the event ids to use instead: tests, and errors found by
    ``headwater.collector.batch``).

    The headers every event shares are packed once for the request (``PackedHeaders``)."""
    shared = ctx.shared_headers()
    shared_packed = pack_headers(shared)
    if ids is None:
        ids = uuid7_batch(len(events), ctx.received_ms)
    ts = ctx.received_ms
    id_name, id_prefix = context.EVENT_ID, _ID_PREFIX
    join = PackedHeaders.join
    prefixes: dict[tuple[str, str], tuple[tuple[Header, ...], bytes]] = {}
    out = []
    for e, eid in zip(events, ids, strict=True):
        kind = (e.type, e.content_type)
        prefix = prefixes.get(kind)
        if prefix is None:
            prefix = prefixes[kind] = _prefix(*kind)
        pairs, packed = prefix
        headers = join(
            (*pairs, (id_name, eid), *shared), b"".join((packed, id_prefix, eid, shared_packed))
        )
        out.append(Message(e.value, e.key, headers, ts))
    return out


def _prefix(event_type: str, content_type: str) -> tuple[tuple[Header, ...], bytes]:
    """The type and content-type headers, and their packed form."""
    pairs = ((context.TYPE, event_type.encode()), (context.CONTENT_TYPE, content_type.encode()))
    return pairs, pack_headers(pairs)


_ID_PREFIX = pack_header(context.EVENT_ID, bytes(36))[:-36]  # every UUID is 36 characters


class Uuid7:
    """UUIDv7 (RFC 9562): 48-bit Unix ms, a 12-bit counter (monotonic within a millisecond),
    62 random bits. Ids from one process sort by creation.

    A batch draws its 62 random bits once and counts in the low 12 of them (one id to the
    next), so that an id is a join of five ready pieces: the millisecond's hex, the counter's
    and the low random bits' (from a table of the 4096 three-digit hex strings), and the fixed
    random hex between them. A counter that passes 4095 carries into the millisecond."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms = 0
        self._counter = 0

    def batch(self, n: int, now_ms: int) -> list[bytes]:
        with self._lock:
            if now_ms > self._ms:
                self._ms, self._counter = now_ms, int.from_bytes(os.urandom(1))
            ms, counter = self._ms, self._counter
            total = counter + n
            self._ms += total >> 12
            self._counter = total & 0xFFF
        rand = int.from_bytes(os.urandom(8)) & ((1 << 62) - 1)
        # variant 0b10 and the high 14 random bits, then the next 36; the low 12 count
        middle = b"-%04x-%09x" % (0x8000 | (rand >> 48), (rand >> 12) & ((1 << 36) - 1))
        low = rand & 0xFFF
        out: list[bytes] = []
        while n > 0:  # one run per millisecond the counter reaches
            k = min(n, 4096 - counter)
            head = b"%08x-%04x-7" % ((ms >> 16) & 0xFFFFFFFF, ms & 0xFFFF)
            out += map(
                b"".join,
                zip(
                    repeat(head, k),
                    _HEX3[counter : counter + k],
                    repeat(middle, k),
                    _HEX3[low : low + k],
                    strict=True,
                ),
            )
            n -= k
            ms, counter, low = ms + 1, 0, (low + k) & 0xFFF
        return out


_HEX3 = [b"%03x" % i for i in range(4096)] * 2  # twice, so that a run of 4096 from any start fits


_UUID7 = Uuid7()


def uuid7_batch(n: int, now_ms: int | None = None) -> list[bytes]:
    """``n`` new UUIDv7s as canonical text (bytes)."""
    return _UUID7.batch(n, now_ms if now_ms is not None else time.time_ns() // 1_000_000)
