"""The batch format's checksum is zlib's CRC-32 (computed by ISA-L), so logs written before and
after that change read the same: a framed batch checks against the standard library's CRC-32,
and a flipped byte anywhere after the crc field is caught."""

from __future__ import annotations

import zlib

import pytest

from headwater.bus.embedded import format as fmt
from headwater.bus.records import Message


def framed() -> bytes:
    messages = [Message(b"v" * (50 + i), b"k%d" % i, (("h", b"x"),), None) for i in range(40)]
    return fmt.frame(fmt.encode(messages, 1_700_000_000_000), base_offset=1234)


def test_the_header_crc_is_zlibs_crc32_of_the_columns_then_the_header_tail() -> None:
    data = framed()
    header = fmt.parse_header(data, 0, len(data))
    body = data[fmt.HEADER_SIZE : header.length]
    tail = data[12 : fmt.HEADER_SIZE]
    assert header.crc == zlib.crc32(tail, zlib.crc32(body))
    fmt.check_crc(data, 0, header)  # and the log's own check agrees


@pytest.mark.parametrize("at", [13, 20, 47, fmt.HEADER_SIZE, fmt.HEADER_SIZE + 500, -1])
def test_a_flipped_byte_fails_the_check(at: int) -> None:
    data = bytearray(framed())
    header = fmt.parse_header(bytes(data), 0, len(data))
    data[at] ^= 0x40
    with pytest.raises(fmt.BadBatch):
        fmt.check_crc(bytes(data), 0, header)
