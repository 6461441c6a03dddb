"""The batch format's checksum is zlib's CRC-32 (computed by ISA-L), so logs written before and
after that change read the same: a framed batch checks against the standard library's CRC-32,
and a flipped byte anywhere after the crc field is caught. Merging batches (an intake worker's
appends of one turn) gives exactly the batch of all their records encoded together."""

from __future__ import annotations

import random
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


def _messages(rng: random.Random, n: int, keyed: bool, headed: bool) -> list[Message]:
    return [
        Message(
            rng.randbytes(rng.randint(0, 60)),
            rng.randbytes(rng.randint(0, 6)) if keyed and rng.random() < 0.7 else None,
            (("h", rng.randbytes(rng.randint(0, 5))),) if headed and rng.random() < 0.8 else (),
            rng.randint(1, 1 << 41),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(40))
def test_merged_batches_are_the_batch_of_all_their_records(seed: int) -> None:
    rng = random.Random(seed)
    groups = [
        _messages(rng, rng.randint(1, 25), rng.random() < 0.5, rng.random() < 0.5)
        for _ in range(rng.randint(1, 6))
    ]
    merged = fmt.merge([fmt.encode(g, 5) for g in groups])
    assert merged == fmt.encode([m for g in groups for m in g], 5)
    data = fmt.frame(merged, base_offset=70)
    header = fmt.parse_header(data, 0, len(data))
    fmt.check_crc(data, 0, header)
    records = fmt.decode_records("t", 0, data, 0, header)
    assert [r.offset for r in records] == list(range(70, 70 + header.count))
    assert [(r.value, r.key, r.timestamp) for r in records] == [
        (m.value, m.key, m.timestamp) for g in groups for m in g
    ]


def test_only_batches_with_contiguous_offsets_merge() -> None:
    whole = fmt.encode([Message(b"a"), Message(b"b")], 5)
    gapped = whole._replace(last_offset_delta=5)  # as compaction leaves a batch
    with pytest.raises(ValueError, match="contiguous"):
        fmt.merge([whole, gapped])


def test_a_merge_into_a_buffer_is_the_same_batch_with_the_buffer_as_its_body() -> None:
    rng = random.Random(7)
    batches = [fmt.encode(_messages(rng, 12, True, True), 5) for _ in range(4)]
    size = sum(len(b.body) for b in batches)
    ring = bytearray(size + 10)
    out = memoryview(ring)[5 : 5 + size]
    merged = fmt.merge_into(batches, out)
    assert merged.body is out
    assert merged._replace(body=bytes(out)) == fmt.merge(batches)
    assert ring[:5] == ring[-5:] == bytes(5)  # nothing written outside it
    with pytest.raises(ValueError, match="take"):
        fmt.merge_into(batches, memoryview(bytearray(size + 1)))
