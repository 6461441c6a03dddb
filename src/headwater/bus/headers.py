"""Record headers in their packed form: ``name_len u16 | name (UTF-8) | value_len u32 | value``,
repeated (little-endian). The embedded log stores headers this way.

``PackedHeaders`` is a headers tuple that also carries its packed bytes and size, so a producer
that sends many events with the same context (the collector) packs the shared part once per
request instead of once per event; the bus then neither re-encodes nor re-measures them.
"""

from __future__ import annotations

import struct
from functools import lru_cache

from headwater.bus.records import Header, Headers

_NAME = struct.Struct("<H")
_VALUE = struct.Struct("<I")


@lru_cache(maxsize=1024)
def _name_prefix(name: str) -> bytes:
    n = name.encode()
    return _NAME.pack(len(n)) + n


def pack_header(name: str, value: bytes) -> bytes:
    return b"".join((_name_prefix(name), _VALUE.pack(len(value)), value))


def pack(headers: Headers) -> bytes:
    """The packed form of ``headers`` (a ``PackedHeaders`` already carries it)."""
    if not headers:
        return b""
    packed = getattr(headers, "packed", None)
    if packed is not None:
        return packed  # type: ignore[no-any-return]
    return b"".join([pack_header(name, value) for name, value in headers])


def unpack(blob: bytes) -> Headers:
    out: list[Header] = []
    pos, end = 0, len(blob)
    while pos < end:
        (nlen,) = _NAME.unpack_from(blob, pos)
        pos += 2
        name = blob[pos : pos + nlen].decode()
        pos += nlen
        (vlen,) = _VALUE.unpack_from(blob, pos)
        pos += 4
        out.append((name, blob[pos : pos + vlen]))
        pos += vlen
    return tuple(out)


def size(headers: Headers) -> int:
    """What headers count against a record's size: names, values and 6 framing bytes each."""
    known = getattr(headers, "size", None)
    if known is not None:
        return known  # type: ignore[no-any-return]
    return sum(len(name) + len(value) + 6 for name, value in headers)


class PackedHeaders(tuple[Header, ...]):
    """Headers with their packed form attached (build with ``PackedHeaders.join``)."""

    packed: bytes
    size: int

    @classmethod
    def join(cls, pairs: Headers, packed: bytes) -> PackedHeaders:
        """``pairs`` whose packing is ``packed`` (the caller packed them, part by part)."""
        h = cls(pairs)
        h.packed = packed
        h.size = len(packed)
        return h
