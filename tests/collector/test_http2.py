"""HTTP/2 helpers of the gRPC intake: header blocks both ways, checked against hpack."""

from __future__ import annotations

import pytest
from hpack import Decoder, Encoder

from headwater.collector import http2 as h2


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 300, 20_000])
def test_a_literal_decodes_to_the_same_field(size: int) -> None:
    value = bytes(i % 26 + 97 for i in range(size))
    block = h2.literal(b"grpc-message", value) + h2.status(415)
    assert Decoder().decode(block, raw=True) == [(b"grpc-message", value), (b":status", b"415")]


def test_blocks_that_refer_to_the_table_decode_by_its_state_not_from_the_cache() -> None:
    """The same block bytes mean different headers once the table has changed."""
    parsed: list[tuple[tuple[bytes, bytes], ...]] = []

    def parse(headers: h2.Headers) -> h2.Headers:
        parsed.append(headers)
        return headers

    blocks = h2.HeaderBlocks(parse, 65_536)
    encoder = Encoder()
    first = encoder.encode([("x-user", "u-1")])  # added to the table: index 62
    refer = b"\xbe"  # "the table's entry 62"
    assert blocks.decode(first) == ((b"x-user", b"u-1"),)
    assert blocks.decode(refer) == ((b"x-user", b"u-1"),)
    assert blocks.decode(refer) == ((b"x-user", b"u-1"),)
    assert len(parsed) == 2  # the second reference came from the cache
    assert blocks.decode(encoder.encode([("x-user", "u-2")])) == ((b"x-user", b"u-2"),)
    assert blocks.decode(refer) == ((b"x-user", b"u-2"),)  # entry 62 is now u-2
    assert len(parsed) == 4


def test_a_table_size_update_is_never_cached() -> None:
    blocks = h2.HeaderBlocks(lambda headers: headers, 65_536)
    encoder = Encoder()
    blocks.decode(encoder.encode([("x-a", "1")]))
    shrink = b"\x20" + b"\xbe"  # size 0 (the table empties), then entry 62: gone
    with pytest.raises(h2.ConnectionFailure) as info:
        blocks.decode(shrink)
    assert info.value.code == h2.COMPRESSION_ERROR


def test_a_block_that_decodes_too_large_breaks_the_connection() -> None:
    blocks = h2.HeaderBlocks(lambda headers: headers, 1_000)
    with pytest.raises(h2.ConnectionFailure, match="cannot be decoded"):
        blocks.decode(Encoder().encode([("x-big", "v" * 2_000)]))
