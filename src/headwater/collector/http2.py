"""The parts of HTTP/2 (RFC 9113) that a server of gRPC unary calls needs: frames, settings,
error codes, and header blocks (RFC 7541).

Header blocks the server sends use no dynamic table (indexed static fields and literals without
indexing), so they are built once and never depend on what the client's decoder holds. Blocks the
client sends are decoded by ``hpack``; ``HeaderBlocks`` answers a block it has seen before from a
cache while the decoder's dynamic table is as it was then, since a gRPC client sends the same few
blocks over and over (after the first call, mostly one-byte references into its table).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Generic, TypeVar

from hpack import Decoder, HPACKError
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# settings
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

# error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
MIN_FRAME_SIZE = 16_384
MAX_FRAME_SIZE_LIMIT = (1 << 24) - 1

FRAME_HEAD = struct.Struct(">HBBBI")
"""A frame's 9-byte head: length (as 16 + 8 bits), type, flags, stream id (top bit reserved)."""
FRAME_HEAD_SIZE = FRAME_HEAD.size
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_GOAWAY = struct.Struct(">II")


class ConnectionFailure(Exception):
    """The connection cannot go on: answered with GOAWAY carrying ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Budget:
    """A token bucket: ``burst`` frames at once, then ``rate`` a second. ``spend(now)`` takes a
    token and says whether there was one (``now`` in seconds, from any monotonic clock)."""

    __slots__ = ("_at", "_tokens", "burst", "rate")

    def __init__(self, burst: float, rate: float) -> None:
        self.burst = burst
        self.rate = rate
        self._tokens = burst
        self._at: float | None = None

    def spend(self, now: float) -> bool:
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= 1
        return self._tokens >= 0

    def earn(self) -> None:
        """One token back (up to ``burst``): for work that shows the peer is in earnest."""
        self._tokens = min(self.burst, self._tokens + 1)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return FRAME_HEAD.pack(size >> 8, size & 0xFF, kind, flags, stream) + payload


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ConnectionFailure(FRAME_SIZE_ERROR, "a SETTINGS frame's length is not 6 per setting")
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, _U32.pack(increment))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream, _U32.pack(code))


def goaway(last_stream: int, code: int, reason: str = "") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream, code) + reason.encode()[:256])


def u32(payload: bytes) -> int:
    """The 31-bit value of a 4-byte payload (RST_STREAM, WINDOW_UPDATE)."""
    return int(_U32.unpack(payload)[0]) & MAX_WINDOW


def strip_padding(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (and a HEADERS frame's priority fields)."""
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise ConnectionFailure(PROTOCOL_ERROR, "a frame's padding is longer than the frame")
        payload = payload[1 : len(payload) - payload[0]]
    return payload


# -- header blocks -------------------------------------------------------------------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer in ``prefix_bits`` bits of a first byte that already holds ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK "literal without indexing, new name" (no Huffman)."""
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


STATUS_200 = b"\x88"  # the static table's entry 8, ":status: 200"


def status(code: int) -> bytes:
    return STATUS_200 if code == 200 else literal(b":status", str(code).encode())


class _CountedTable(HeaderTable):  # type: ignore[misc]
    """hpack's table, counting the entries it is given (each one changes what indexes mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)


Headers = tuple[tuple[bytes, bytes], ...]
T = TypeVar("T")


class HeaderBlocks(Generic[T]):
    """Decodes a connection's header blocks in order and returns ``parse(headers)`` for each.

    A block is decoded once per state of the dynamic table: a block that neither adds to the
    table nor resizes it decodes to the same headers for as long as the table is unchanged, so
    its parsed result is kept (up to ``CACHED`` blocks) and returned while the table's change
    count is what it was. Every block still has to come here, in the order received, since
    blocks that add entries change what later ones mean.
    """

    CACHED = 64

    def __init__(self, parse: Callable[[Headers], T], max_list_bytes: int) -> None:
        self._parse = parse
        self._decoder = Decoder(max_header_list_size=max_list_bytes)
        self._table = _CountedTable()
        self._decoder.header_table = self._table
        self._resizes = 0
        self._cache: dict[bytes, tuple[int, T]] = {}

    def decode(self, block: bytes) -> T:
        version = self._table.changes + self._resizes
        hit = self._cache.get(block)
        if hit is not None and hit[0] == version:
            return hit[1]
        try:
            headers = tuple(self._decoder.decode(block, raw=True))
        except (HPACKError, ValueError, IndexError) as e:
            raise ConnectionFailure(
                COMPRESSION_ERROR, f"a header block cannot be decoded: {e}"
            ) from e
        parsed = self._parse(headers)
        if block[:1] and block[0] & 0xE0 == 0x20:  # a table size update (only ever first)
            self._resizes += 1
        elif self._table.changes + self._resizes == version:
            if len(self._cache) >= self.CACHED:
                self._cache.clear()
            self._cache[block] = (version, parsed)
        return parsed
