"""headwater's Kafka wire code without a broker (``bus.kafka.protocol``): varints, record
batches byte for byte as the protocol specifies them, the collector's fast encoding against the
general one, and responses that are short or malformed."""

from __future__ import annotations

import struct

import google_crc32c
import pytest

from headwater.bus.kafka.protocol import api, codec, records
from headwater.bus.kafka.protocol.codec import ProtocolError, Reader
from headwater.bus.kafka.sender import MessageChunk
from headwater.bus.records import Message
from headwater.collector.events import EventIn, RequestContext, to_messages
from headwater.collector.kafka_batch import MAX_CHUNK_BYTES, event_chunks

CTX = RequestContext("raccoon-ws", "default", "req-1", 1_795_931_111_120, "10.0.0.7", "sdk/1.2")


@pytest.mark.parametrize(
    ("n", "encoded"),
    [
        (0, b"\x00"),
        (-1, b"\x01"),
        (1, b"\x02"),
        (63, b"\x7e"),
        (-64, b"\x7f"),
        (64, b"\x80\x01"),
        (300, b"\xd8\x04"),
        (-(1 << 63), b"\xff" * 9 + b"\x01"),
    ],
)
def test_zigzag_varints(n: int, encoded: bytes) -> None:
    assert codec.zigzag(n) == encoded
    assert codec.varint(n) == encoded


def test_the_varint_table_is_the_function() -> None:
    assert all(codec.ZIGZAG[n] == codec.zigzag(n) for n in range(0, codec.ZIGZAG_TABLE_SIZE, 7))
    assert codec.varint(codec.ZIGZAG_TABLE_SIZE) == codec.zigzag(codec.ZIGZAG_TABLE_SIZE)
    with pytest.raises(ValueError, match="varlong"):
        codec.zigzag(1 << 63)


def test_the_checksum_is_crc32c() -> None:
    assert google_crc32c.value(b"123456789") == 0xE3069283  # CRC-32C's check value


def test_one_record_as_the_protocol_lays_it_out() -> None:
    # length 8 | attributes 0 | timestampDelta 0 | offsetDelta 0 | key -1 | value 2 "hi" |
    # 0 headers
    assert records.encode_record(0, 0, None, b"hi", records.encode_headers(())) == bytes.fromhex(
        "10 00 00 00 01 04 6869 00"
    )
    headers = records.encode_headers((("k", b"v"), ("e", b"")))
    assert headers == bytes.fromhex("04 02 6b 02 76 02 65 00")


def test_a_batch_header_field_by_field() -> None:
    data = records.encode_messages(
        [Message(b"a", None, (), 1_000), Message(b"bc", b"k", (), 998)], 0, 998
    )
    head = records.header(
        data,
        2,
        base_timestamp=998,
        max_timestamp=1_000,
        producer_id=77,
        producer_epoch=3,
        base_sequence=40,
    )
    assert len(head) == records.HEADER_SIZE == 61
    batch = head + data
    base, length, leader_epoch, magic, crc = struct.unpack_from(">qiibI", batch)
    assert (base, length, leader_epoch, magic) == (0, len(batch) - 12, -1, 2)
    assert crc == google_crc32c.value(batch[21:])  # from the attributes to the end
    attrs, last_delta, base_ts, max_ts, pid, epoch, seq, count = struct.unpack_from(
        ">hiqqqhii", batch, 21
    )
    assert (attrs, last_delta, base_ts, max_ts) == (0, 1, 998, 1_000)
    assert (pid, epoch, seq, count) == (77, 3, 40, 2)
    [decoded] = records.decode_batches(batch)
    assert [(r.offset, r.timestamp, r.key, r.value) for r in decoded.records] == [
        (0, 1_000, None, b"a"),
        (1, 998, b"k", b"bc"),
    ]


def test_messages_round_trip_with_every_kind_of_field() -> None:
    messages = [
        Message(b"", None, (), 5),
        Message(b"x" * 70_000, b"key", (("h\u00e9", b"\x00\xff"), ("empty", b"")), 4),
        Message(b"v", b"", (("a", b"1"),) * 3, 2**40),
    ]
    chunk = MessageChunk(messages)
    data = chunk.records(0, chunk.first_timestamp)
    assert chunk.size >= len(data)
    head = records.header(
        data, 3, base_timestamp=chunk.first_timestamp, max_timestamp=chunk.last_timestamp
    )
    [batch] = records.decode_batches(head + data)
    assert [(r.timestamp, r.key, r.value, records.headers_of(r)) for r in batch.records] == [
        (m.timestamp, m.key, m.value, list(m.headers)) for m in messages
    ]


def test_an_lz4_batch_decodes_to_its_records() -> None:
    messages = [Message(b"v%d" % i, None, (("type", b"click"),) * 4, 7) for i in range(500)]
    data = records.encode_messages(messages, 0, 7)
    packed = records.compress(data, records.LZ4)
    assert len(packed) < len(data) / 4  # headers repeat: what compression is for
    head = records.header(packed, 500, base_timestamp=7, max_timestamp=7, compression=records.LZ4)
    assert struct.unpack_from(">h", head, 21)[0] == records.LZ4
    [batch] = records.decode_batches(head + packed)
    assert [r.value for r in batch.records] == [m.value for m in messages]


def test_damaged_batches_are_refused() -> None:
    data = records.encode_messages([Message(b"abc", None, (), 1)], 0, 1)
    batch = records.header(data, 1, base_timestamp=1, max_timestamp=1) + data
    flipped = bytearray(batch)
    flipped[-2] ^= 0x01
    with pytest.raises(ProtocolError, match="CRC"):
        records.decode_batches(bytes(flipped))
    with pytest.raises(ProtocolError, match="whole"):
        records.decode_batches(batch[:-1])
    with pytest.raises(ValueError, match="at least one record"):
        records.header(b"", 0, base_timestamp=0, max_timestamp=0)


def events(n: int, *, kinds: int = 1) -> list[EventIn]:
    types = ["click", "view", "buy"][:kinds]
    return [
        EventIn(types[(i // 7) % kinds], bytes([i % 251]) * (100 + i % 9), "application/x-protobuf")
        for i in range(n)
    ]


@pytest.mark.parametrize("kinds", [1, 3])
def test_the_collectors_records_are_those_of_its_messages(kinds: int) -> None:
    """``collector.kafka_batch`` makes, byte for byte, the records of ``to_messages``."""
    evs = events(120, kinds=kinds)
    [chunk] = event_chunks(evs, CTX, 1 << 20, "topic")
    general = MessageChunk(to_messages(evs, CTX, ids=chunk.ids))
    for first_delta, base in ((0, CTX.received_ms), (65_530, CTX.received_ms - 3)):
        assert chunk.records(first_delta, base) == general.records(first_delta, base)
    assert chunk.size >= len(chunk.records(0, CTX.received_ms))


def test_a_large_request_is_cut_into_chunks_in_order() -> None:
    evs = [
        EventIn(t, b"%d" % i + b"x" * 9_000, "application/json")
        for i, t in enumerate(["a", "b"] * 100)
    ]
    chunks = event_chunks(evs, CTX, 1 << 20, "topic")
    assert len(chunks) > 1
    assert all(c.size <= MAX_CHUNK_BYTES * 1.05 for c in chunks)
    data = b"".join(c.records(0, CTX.received_ms) for c in chunks)
    values = []
    for c in chunks:
        body = c.records(0, CTX.received_ms)
        head = records.header(
            body, c.count, base_timestamp=c.first_timestamp, max_timestamp=c.last_timestamp
        )
        values += [r.value for r in records.decode_batches(head + body)[0].records]
    assert values == [e.value for e in evs]
    assert len(data) > 0


def test_the_collectors_records_are_checked_as_the_bus_checks_them() -> None:
    from headwater.bus.errors import RecordTooLarge

    evs = events(5)
    evs[3] = EventIn("click", b"x" * 2_000, "application/json")
    with pytest.raises(RecordTooLarge) as raised:
        event_chunks(evs, CTX, 1_000, "topic")
    assert raised.value.index == 3


def test_requests_are_framed_with_their_size_and_header() -> None:
    body = api.produce_request(-1, 30_000, {"t": [(1, [b"AB", b"CD"])]})
    framed = b"".join(api.frame(api.API_PRODUCE, 8, 42, "hw", body))
    (size,) = struct.unpack_from(">i", framed)
    assert size == len(framed) - 4
    assert struct.unpack_from(">hhih", framed, 4) == (0, 8, 42, 2)
    assert framed.endswith(struct.pack(">ii", 1, 4) + b"ABCD")


def metadata_v7() -> bytes:
    def s(text: str) -> bytes:
        return struct.pack(">h", len(text)) + text.encode()

    brokers = struct.pack(">i", 1) + struct.pack(">i", 5) + s("h1") + struct.pack(">i", 9092)
    brokers += struct.pack(">h", -1)  # rack: null
    partition = (
        struct.pack(">hiii", 0, 0, 5, 7) + struct.pack(">ii", 1, 5) + struct.pack(">ii", 1, 5)
    )
    partition += struct.pack(">i", 0)  # offline replicas
    topic = struct.pack(">h", 0) + s("events") + b"\x00" + struct.pack(">i", 1) + partition
    return (
        struct.pack(">i", 0)
        + brokers
        + s("cluster")
        + struct.pack(">i", 5)
        + struct.pack(">i", 1)
        + topic
    )


def test_a_metadata_response_is_read() -> None:
    meta = api.metadata_response(metadata_v7())
    assert meta.brokers == {5: ("h1", 9092)}
    [p] = meta.topics["events"].partitions
    assert (p.index, p.leader, p.leader_epoch, p.replicas, p.isr) == (0, 5, 7, [5], [5])


@pytest.mark.parametrize("cut", [3, 20, 60])
def test_a_short_response_names_the_message_and_the_byte(cut: int) -> None:
    with pytest.raises(ProtocolError, match=r"MetadataResponse v7: at byte \d+ of \d+"):
        api.metadata_response(metadata_v7()[:cut])


def test_a_longer_response_is_another_version() -> None:
    with pytest.raises(ProtocolError, match="left over"):
        api.metadata_response(metadata_v7() + b"\x00")


def test_an_impossible_array_is_refused_before_it_is_read() -> None:
    with pytest.raises(ProtocolError, match="cannot fit"):
        Reader(struct.pack(">i", 1_000_000) + b"\x00", "X").int32_array()


def test_produce_responses_carry_the_brokers_words() -> None:
    def s(text: str) -> bytes:
        return struct.pack(">h", len(text)) + text.encode()

    partition = struct.pack(">ihqqq", 3, 87, -1, -1, 0)
    partition += struct.pack(">i", 1) + struct.pack(">i", 2) + s("bad timestamp")
    partition += s("one record was invalid")
    body = struct.pack(">i", 1) + s("t") + struct.pack(">i", 1) + partition + struct.pack(">i", 0)
    [result] = api.produce_response(body, 8)["t"]
    assert (result.index, result.error) == (3, 87)
    assert result.message == "one record was invalid; record 2: bad timestamp"


def test_versions_are_negotiated_or_refused_by_name() -> None:
    served = {api.API_PRODUCE: (3, 13), api.API_METADATA: (0, 13)}
    assert api.choose_version(api.API_PRODUCE, served) == 8
    assert api.choose_version(api.API_METADATA, served) == 7
    with pytest.raises(api.UnsupportedBroker, match="InitProducerId not at all"):
        api.choose_version(api.API_INIT_PRODUCER_ID, served)
    with pytest.raises(api.UnsupportedBroker, match="Produce versions 0-2"):
        api.choose_version(api.API_PRODUCE, {api.API_PRODUCE: (0, 2)})
