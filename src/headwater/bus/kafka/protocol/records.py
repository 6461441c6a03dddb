"""Record batches of magic 2 (KIP-98), uncompressed, as a producer writes them.

A batch is a 61-byte header and its records::

    baseOffset int64 | batchLength int32 | partitionLeaderEpoch int32 | magic int8 (2) |
    crc uint32 (CRC-32C of everything after it) | attributes int16 | lastOffsetDelta int32 |
    baseTimestamp int64 | maxTimestamp int64 | producerId int64 | producerEpoch int16 |
    baseSequence int32 | recordCount int32 | records

and a record is ``length varint | attributes int8 | timestampDelta varlong | offsetDelta
varint | keyLength varint | key | valueLength varint | value | headerCount varint | headers``,
a header ``keyLength varint | key (UTF-8) | valueLength varint | value`` (lengths -1 for null).

The producer id, epoch and base sequence sit inside the checksummed part, so a batch's header
is made when it is sent (``header``), after its records were encoded: records are encoded once,
whatever the sequence they are sent under.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from headwater.bus.kafka.protocol.codec import ProtocolError, varint
from headwater.bus.records import Header, Headers, Message
from headwater.errors import MissingDependencyError

try:
    import google_crc32c
except ImportError as exc:  # pragma: no cover - part of the kafka extra
    raise MissingDependencyError("google_crc32c", "kafka") from exc

MAGIC = 2
NONE = 0
LZ4 = 3  # the codec numbers of a batch's attributes (0-2 bits): gzip 1, snappy 2, zstd 4
HEADER_SIZE = 61
# Bytes from the start of a batch to its CRC's first covered byte (the attributes).
_CRC_FROM = 21
# After baseOffset and batchLength: what batchLength counts from.
_LENGTH_FROM = 12
_PREFIX = struct.Struct(">qiibI")  # baseOffset, batchLength, partitionLeaderEpoch, magic, crc
_TAIL = struct.Struct(">hiqqqhii")  # attributes ... recordCount
NO_PRODUCER_ID = -1
NO_SEQUENCE = -1
_NULL = varint(-1)


def header(
    records: bytes,
    count: int,
    *,
    base_timestamp: int,
    max_timestamp: int,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = -1,
    base_sequence: int = NO_SEQUENCE,
    compression: int = NONE,
) -> bytes:
    """The 61 bytes before ``records`` (``count`` encoded records, offset deltas from 0, as
    they are or compressed with ``compression``)."""
    if count < 1:
        raise ValueError("a record batch holds at least one record")
    tail = _TAIL.pack(
        compression,  # attributes: the codec; CreateTime, not transactional, not control
        count - 1,
        base_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        base_sequence,
        count,
    )
    crc = google_crc32c.extend(google_crc32c.value(tail), records)
    return _PREFIX.pack(0, HEADER_SIZE - _LENGTH_FROM + len(records), -1, MAGIC, crc) + tail


def compress(records: bytes, codec: int) -> bytes:
    """``records`` compressed as a batch of codec ``codec`` holds them: LZ4 is an LZ4 frame
    (KIP-57) of independent 64 KiB blocks, without checksums other than the batch's CRC."""
    if codec == NONE:
        return records
    if codec != LZ4:
        raise ValueError(f"codec {codec} is not one headwater writes (0: none, 3: lz4)")
    return bytes(
        _lz4().compress(records, block_linked=False, store_size=False, compression_level=0)
    )


def decompress(data: bytes, codec: int) -> bytes:
    if codec == NONE:
        return data
    if codec != LZ4:
        raise ProtocolError(f"batches of codec {codec} are not decoded here")
    try:
        return bytes(_lz4().decompress(data))
    except RuntimeError as e:
        raise ProtocolError(f"an LZ4 batch does not decompress: {e}") from None


def _lz4() -> Any:
    try:
        import lz4.frame
    except ImportError as exc:  # pragma: no cover - part of the kafka extra
        raise MissingDependencyError("lz4", "kafka") from exc
    return lz4.frame


# -- encoding records -------------------------------------------------------------------------
def encode_header(name: str, value: bytes | None) -> bytes:
    key = name.encode()
    if value is None:
        return b"".join((varint(len(key)), key, _NULL))
    return b"".join((varint(len(key)), key, varint(len(value)), value))


def encode_headers(headers: Headers) -> bytes:
    """``headerCount`` and the headers of one record."""
    return varint(len(headers)) + b"".join([encode_header(n, v) for n, v in headers])


def encode_record(
    offset_delta: int, timestamp_delta: int, key: bytes | None, value: bytes | None, headers: bytes
) -> bytes:
    """One record, ``headers`` already encoded (``encode_headers``)."""
    body = b"".join(
        (
            b"\x00",  # attributes (unused)
            varint(timestamp_delta),
            varint(offset_delta),
            _NULL if key is None else varint(len(key)) + key,
            _NULL if value is None else varint(len(value)),
            b"" if value is None else value,
            headers,
        )
    )
    return varint(len(body)) + body


def record_size(key: bytes | None, value: bytes, headers: Headers) -> int:
    """An upper bound of a record's encoded size (its deltas at their widest)."""
    size = 1 + 10 + 5 + 5 + 5 + len(value) + 5
    size += len(key) if key is not None else 0
    for name, v in headers:
        size += 10 + len(name.encode()) + len(v)
    return size


def encode_messages(messages: Sequence[Message], first_delta: int, base_timestamp: int) -> bytes:
    """``messages``' records, their offset deltas from ``first_delta``, their timestamps as
    deltas from ``base_timestamp`` (a message's ``timestamp`` must be set)."""
    out = []
    for i, m in enumerate(messages):
        assert m.timestamp is not None
        out.append(
            encode_record(
                first_delta + i,
                m.timestamp - base_timestamp,
                m.key,
                m.value,
                encode_headers(m.headers),
            )
        )
    return b"".join(out)


def checksum(data: bytes) -> int:
    return int(google_crc32c.value(data))


# -- decoding (tests, and checking what a broker returns) -------------------------------------
@dataclass(frozen=True, slots=True)
class DecodedRecord:
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    base_offset: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    base_timestamp: int
    max_timestamp: int
    records: list[DecodedRecord]


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = u = 0
    while True:
        if pos >= len(data):
            raise ProtocolError("a varint runs past the end of the batch")
        b = data[pos]
        pos += 1
        u |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift > 63:
            raise ProtocolError("a varint is longer than 10 bytes")
    return (u >> 1) ^ -(u & 1), pos


def _read_bytes(data: bytes, pos: int) -> tuple[bytes | None, int]:
    n, pos = _read_varint(data, pos)
    if n == -1:
        return None, pos
    if n < 0 or pos + n > len(data):
        raise ProtocolError(f"a field of {n} bytes runs past the end of the record")
    return data[pos : pos + n], pos + n


def decode_batches(data: bytes) -> list[DecodedBatch]:
    """Every batch in ``data`` (magic 2, uncompressed), checking lengths and CRCs."""
    out = []
    pos = 0
    while pos < len(data):
        if pos + HEADER_SIZE > len(data):
            raise ProtocolError(f"a batch header at byte {pos} runs past the end")
        base_offset, length, _epoch, magic, crc = _PREFIX.unpack_from(data, pos)
        end = pos + _LENGTH_FROM + length
        if magic != MAGIC or end > len(data) or length < HEADER_SIZE - _LENGTH_FROM:
            raise ProtocolError(f"the batch at byte {pos} is not a whole magic-2 batch")
        if checksum(data[pos + _CRC_FROM : end]) != crc:
            raise ProtocolError(f"the batch at byte {pos} fails its CRC-32C")
        attrs, last_delta, base_ts, max_ts, pid, pepoch, seq, count = _TAIL.unpack_from(
            data, pos + _CRC_FROM
        )
        body = decompress(data[pos + HEADER_SIZE : end], attrs & 0x7)
        rpos = 0
        records = []
        for _ in range(count):
            size, rpos = _read_varint(body, rpos)
            rend = rpos + size
            rpos += 1  # attributes
            ts_delta, rpos = _read_varint(body, rpos)
            off_delta, rpos = _read_varint(body, rpos)
            key, rpos = _read_bytes(body, rpos)
            value, rpos = _read_bytes(body, rpos)
            nheaders, rpos = _read_varint(body, rpos)
            headers = []
            for _ in range(nheaders):
                name, rpos = _read_bytes(body, rpos)
                hvalue, rpos = _read_bytes(body, rpos)
                headers.append(((name or b"").decode(), hvalue))
            if rpos != rend:
                raise ProtocolError("a record's length does not match its fields")
            records.append(
                DecodedRecord(
                    base_offset + off_delta, base_ts + ts_delta, key, value, tuple(headers)
                )
            )
        if rpos != len(body) or (records and records[-1].offset - base_offset != last_delta):
            raise ProtocolError("a batch's length or last offset delta does not match")
        out.append(DecodedBatch(base_offset, pid, pepoch, seq, base_ts, max_ts, records))
        pos = end
    return out


def headers_of(record: DecodedRecord) -> list[Header]:
    return [(n, v if v is not None else b"") for n, v in record.headers]
