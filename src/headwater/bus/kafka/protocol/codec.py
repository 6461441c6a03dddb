"""The Kafka protocol's primitive types: big-endian integers, strings, bytes, arrays, and the
zigzag varints of record batches.

Writing is done with ``struct`` formats and ``bytes`` joins by each message; ``Reader`` parses
a response and raises ``ProtocolError`` when a field runs past the end or is malformed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INT8 = struct.Struct(">b")
INT16 = struct.Struct(">h")
INT32 = struct.Struct(">i")
INT64 = struct.Struct(">q")
UINT32 = struct.Struct(">I")


class ProtocolError(Exception):
    """Bytes from the broker that do not parse as the message they should be."""


def string(value: str | None) -> bytes:
    """A (nullable) ``string``: int16 length, then UTF-8; null is length -1."""
    if value is None:
        return INT16.pack(-1)
    data = value.encode()
    if len(data) > 0x7FFF:
        raise ValueError(f"a protocol string holds at most 32,767 bytes, not {len(data):,}")
    return INT16.pack(len(data)) + data


def array(items: list[bytes] | None) -> bytes:
    """An ``array`` of already-encoded items: int32 count, then the items; null is -1."""
    if items is None:
        return INT32.pack(-1)
    return INT32.pack(len(items)) + b"".join(items)


def zigzag(n: int) -> bytes:
    """A signed varint (zigzag, then 7 bits a byte, low first), as record fields use."""
    if not -(1 << 63) <= n < (1 << 63):
        raise ValueError(f"{n} does not fit a varlong")
    u = (n << 1) ^ (n >> 63)
    out = bytearray()
    while u >= 0x80:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


#: ``zigzag(n)`` for every ``0 <= n < ZIGZAG_TABLE_SIZE``: lengths and offset deltas of records
#: are looked up here instead of computed (one list index a field).
ZIGZAG_TABLE_SIZE = 1 << 16
ZIGZAG = [zigzag(n) for n in range(ZIGZAG_TABLE_SIZE)]


def varint(n: int) -> bytes:
    """``zigzag(n)``, from the table when it is there."""
    return ZIGZAG[n] if 0 <= n < ZIGZAG_TABLE_SIZE else zigzag(n)


class Reader:
    """Reads fields in order from a response body."""

    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what  # for errors: "MetadataResponse v7"

    def _take(self, fmt: struct.Struct) -> int:
        try:
            (value,) = fmt.unpack_from(self.data, self.pos)
        except struct.error:
            raise self.error(f"needs {fmt.size} more bytes") from None
        self.pos += fmt.size
        return int(value)

    def error(self, problem: str) -> ProtocolError:
        return ProtocolError(f"{self.what}: at byte {self.pos} of {len(self.data)}: {problem}")

    def int8(self) -> int:
        return self._take(INT8)

    def int16(self) -> int:
        return self._take(INT16)

    def int32(self) -> int:
        return self._take(INT32)

    def int64(self) -> int:
        return self._take(INT64)

    def boolean(self) -> bool:
        return self._take(INT8) != 0

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.error(f"a field of {n} bytes runs past the end")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def string(self) -> str:
        value = self.nullable_string()
        if value is None:
            raise self.error("a string that may not be null is null")
        return value

    def nullable_string(self) -> str | None:
        n = self.int16()
        if n == -1:
            return None
        try:
            return self.raw(n).decode()
        except UnicodeDecodeError:
            raise self.error("a string is not UTF-8") from None

    def array(self, item: Callable[[Reader], T]) -> list[T]:
        n = self.int32()
        if n == -1:
            return []
        if n < 0 or n > len(self.data) - self.pos:  # every item takes at least a byte
            raise self.error(f"an array of {n} items cannot fit")
        return [item(self) for _ in range(n)]

    def int32_array(self) -> list[int]:
        return self.array(Reader.int32)

    def end(self) -> None:
        """Every byte was read (a longer body means another version than the one asked)."""
        if self.pos != len(self.data):
            raise self.error(f"{len(self.data) - self.pos} bytes left over")
