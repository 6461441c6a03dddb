"""headwater's own Kafka producer (``bus.kafka.sender``) against Apache Kafka: what it writes
is read back by librdkafka with its checksums checked; answers lost on the way are sent again
and stored once (idempotence); a batch the broker refuses fails alone and the producer goes on;
a broker that stops and comes back loses nothing acknowledged. Malformed answers come from a
fake broker (a real one does not send them)."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from headwater.bus.errors import BusUnavailable, RecordTooLarge
from headwater.bus.kafka.connection import Connection, ConnectionLost
from headwater.bus.kafka.protocol import records
from headwater.bus.kafka.protocol.codec import ProtocolError
from headwater.bus.kafka.sender import KafkaSender, MessageChunk
from headwater.bus.records import Message
from headwater.testing.kafka import KafkaCluster, start_kafka
from headwater.testing.kafka_proxy import KafkaProxy

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
NOW = 1_795_000_000_000


def create(cluster: KafkaCluster, topic: str, partitions: int = 2, **config: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    admin.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result(30)


def read_all(cluster: KafkaCluster, topic: str, partition: int) -> list[Any]:
    """Every record of ``topic[partition]``, read by librdkafka with CRC checks."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": cluster.bootstrap_servers,
            "group.id": f"check-{uuid.uuid4().hex}",
            "check.crcs": True,
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, partition, 0)])
    out = []
    deadline = time.monotonic() + 30
    try:
        while True:
            assert time.monotonic() < deadline, "no end of the partition within 30 s"
            for m in consumer.consume(1000, timeout=0.2):
                if m.error() is not None:
                    if m.error().code() == -191:  # _PARTITION_EOF
                        return out
                    raise AssertionError(m.error())
                out.append(m)
    finally:
        consumer.close()


def chunk(tag: str, n: int, **fields: Any) -> MessageChunk:
    return MessageChunk(
        [Message(b"%s-%d" % (tag.encode(), i), None, (), NOW + i, **fields) for i in range(n)]
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def started(cluster: KafkaCluster, **options: Any) -> KafkaSender:
    sender = KafkaSender(cluster.bootstrap_servers, request_timeout_s=10, **options)
    await sender.start()
    return sender


@pytest.mark.parametrize("codec", [records.NONE, records.LZ4], ids=["plain", "lz4"])
def test_records_are_read_back_by_librdkafka(kafka_broker: KafkaCluster, codec: int) -> None:
    topic = unique("sender-fields")
    create(kafka_broker, topic)
    messages = [
        Message(b"first", b"key-1", (("type", b"click"), ("empty", b"")), NOW),
        Message(b"", None, (), NOW - 5),
        Message(b"x" * 300_000, b"", (("caf\u00e9", b"\x00\x01"),), NOW + 7),
    ]

    async def scenario() -> list[int]:
        sender = await started(kafka_broker, compression=codec)
        try:
            return list(
                await asyncio.gather(
                    sender.send(topic, 1, MessageChunk(messages)),
                    sender.send(topic, 1, chunk("b", 3)),
                )
            )
        finally:
            await sender.close(10)

    bases = asyncio.run(scenario())
    stored = read_all(kafka_broker, topic, 1)
    assert bases == [0, 3]
    assert [(m.offset(), m.key(), m.value(), m.timestamp()[1]) for m in stored[:3]] == [
        (i, msg.key, msg.value, msg.timestamp) for i, msg in enumerate(messages)
    ]
    assert stored[0].headers() == [("type", b"click"), ("empty", b"")]
    assert stored[2].headers() == [("caf\u00e9", b"\x00\x01")]
    assert [m.value() for m in stored[3:]] == [b"b-0", b"b-1", b"b-2"]


def test_chunks_sent_together_keep_their_order_and_offsets(kafka_broker: KafkaCluster) -> None:
    topic = unique("sender-order")
    create(kafka_broker, topic)
    count = 1_000

    async def scenario() -> tuple[list[int], KafkaSender]:
        sender = await started(kafka_broker)
        try:
            futures = [sender.send(topic, i % 2, chunk(f"c{i}", 10)) for i in range(count)]
            return list(await asyncio.gather(*futures)), sender
        finally:
            await sender.close(10)

    bases, sender = asyncio.run(scenario())
    for p in (0, 1):
        ours = bases[p::2]
        assert ours == [10 * k for k in range(count // 2)], "offsets out of send order"
        values = [m.value() for m in read_all(kafka_broker, topic, p)]
        assert values == [b"c%d-%d" % (i, j) for i in range(p, count, 2) for j in range(10)]
    assert sender.stats.batches < count, "chunks queued together should share batches"
    assert sender.stats.retries == sender.stats.resets == 0


def test_a_lost_answer_is_sent_again_and_stored_once(kafka_broker: KafkaCluster) -> None:
    """The broker stores a batch and the answer never arrives: the producer sends it again
    with the same sequence, the broker recognises it, and it is stored once."""
    topic = unique("sender-lost")
    create(kafka_broker, topic, partitions=1)
    host, port = kafka_broker.bootstrap_servers.split(",")[0].rsplit(":", 1)

    async def scenario() -> tuple[list[int], KafkaSender, int]:
        proxy = KafkaProxy(host, int(port))
        await proxy.start()
        sender = KafkaSender(kafka_broker.bootstrap_servers, request_timeout_s=10)
        sender.route = proxy.route  # type: ignore[method-assign]
        await sender.start()
        try:
            bases: list[int] = []
            for round_ in range(3):
                proxy.lose_produce_answers(1)
                futures = [sender.send(topic, 0, chunk(f"r{round_}-{i}", 5)) for i in range(40)]
                bases += await asyncio.gather(*futures)
            return bases, sender, proxy.lost
        finally:
            await sender.close(10)
            await proxy.close()

    bases, sender, lost = asyncio.run(scenario())
    assert lost == 3
    assert sender.stats.retries >= 3
    assert bases == [5 * k for k in range(120)], "an acknowledged offset is not where it landed"
    values = [m.value() for m in read_all(kafka_broker, topic, 0)]
    expected = [b"r%d-%d-%d" % (r, i, j) for r in range(3) for i in range(40) for j in range(5)]
    assert values == expected, "a batch was stored twice, lost or reordered"


def test_a_batch_the_broker_refuses_fails_alone(kafka_broker: KafkaCluster) -> None:
    topic = unique("sender-refused")
    create(kafka_broker, topic, partitions=1, **{"max.message.bytes": "20000"})

    async def scenario() -> tuple[list[Any], list[int], KafkaSender]:
        sender = await started(kafka_broker)
        try:
            big = MessageChunk([Message(b"x" * 30_000, None, (), NOW)])
            first = [sender.send(topic, 0, chunk("a", 3)), sender.send(topic, 0, big)]
            outcomes = await asyncio.gather(*first, return_exceptions=True)
            later = await asyncio.gather(
                *[sender.send(topic, 0, chunk(f"b{i}", 2)) for i in range(5)]
            )
            return outcomes, list(later), sender
        finally:
            await sender.close(10)

    outcomes, later, sender = asyncio.run(scenario())
    values = [m.value() for m in read_all(kafka_broker, topic, 0)]
    # the two chunks shared a batch, so the broker refused both; the producer went on
    assert all(isinstance(o, RecordTooLarge) for o in outcomes), outcomes
    assert "MESSAGE_TOO_LARGE" in str(outcomes[0])
    assert sender.stats.resets >= 1
    assert values == [b"b%d-%d" % (i, j) for i in range(5) for j in range(2)]
    assert later == [0, 2, 4, 6, 8]


def test_a_partition_without_a_leader_times_out(kafka_broker: KafkaCluster) -> None:
    async def scenario() -> BaseException | int:
        sender = await started(kafka_broker, delivery_timeout_s=1.5)
        try:
            outcome = await asyncio.gather(
                sender.send(unique("sender-missing"), 0, chunk("m", 1)), return_exceptions=True
            )
            return outcome[0]
        finally:
            await sender.close(5)

    error = asyncio.run(scenario())
    assert isinstance(error, BusUnavailable) and error.transient
    assert "not sent within" in str(error)


@pytest.fixture
def own_broker() -> Iterator[KafkaCluster]:
    with start_kafka() as cluster:
        yield cluster


def test_a_broker_that_stops_and_returns_loses_nothing_acknowledged(
    own_broker: KafkaCluster,
) -> None:
    topic = unique("sender-restart")
    create(own_broker, topic, partitions=2)
    acked: list[bytes] = []
    failed: list[BaseException] = []

    async def scenario() -> None:
        sender = await started(own_broker, delivery_timeout_s=60)
        loop = asyncio.get_running_loop()

        async def one(i: int) -> None:
            c = chunk(f"e{i}", 4)
            try:
                await sender.send(topic, i % 2, c)
                acked.extend(m.value for m in c.messages)
            except BusUnavailable as e:
                failed.append(e)

        try:
            first = [asyncio.ensure_future(one(i)) for i in range(200)]
            await asyncio.gather(*first)
            pending = [asyncio.ensure_future(one(i)) for i in range(200, 400)]
            await loop.run_in_executor(None, own_broker.kill, 0)
            pending += [asyncio.ensure_future(one(i)) for i in range(400, 500)]
            await loop.run_in_executor(None, own_broker.restart, 0)
            await asyncio.gather(*pending)
            await asyncio.gather(*[one(i) for i in range(500, 550)])
        finally:
            await sender.close(10)

    asyncio.run(scenario())
    stored = [m.value() for p in (0, 1) for m in read_all(own_broker, topic, p)]
    assert len(stored) == len(set(stored)), "a record is stored twice"
    assert set(acked) <= set(stored), "an acknowledged record is missing"
    assert len(acked) >= 4 * 250  # before the kill and after the restart at least
    assert all(e.transient for e in failed)


# -- a fake broker: answers a real one never gives (a mock, since Kafka cannot be made to) ------
async def fake_broker(answer: bytes | None) -> tuple[asyncio.Server, int]:
    """A server that reads one request and writes ``answer`` (None: says nothing)."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            (size,) = struct.unpack(">i", await r.readexactly(4))
            await r.readexactly(size)
            if answer is not None:
                w.write(answer)
                await w.drain()
            await r.read()  # keep the connection open: the client must give up by itself
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        (struct.pack(">ii", 6, 99) + b"\x00\x00", ProtocolError, "not in order"),
        (struct.pack(">i", 1 << 30), ProtocolError, "frame of"),
        (struct.pack(">i", 2) + b"\x00\x00", ProtocolError, "frame of"),
        (
            struct.pack(">ii", 10, 1) + b"\x00\x23" + struct.pack(">i", 0),
            None,
            "refused ApiVersions",
        ),
        (
            struct.pack(">ii", 12, 1) + b"\x00\x00" + struct.pack(">i", 9) + b"\x00\x00",
            ProtocolError,
            "ApiVersionsResponse",
        ),
        (None, ConnectionLost, "did not answer"),
    ],
    ids=["out-of-order", "huge-frame", "tiny-frame", "error-code", "short-body", "silence"],
)
def test_malformed_answers_close_the_connection(
    answer: bytes | None, error: type[Exception] | None, words: str
) -> None:
    async def scenario() -> Exception:
        server, port = await fake_broker(answer)
        try:
            with pytest.raises(Exception) as raised:
                await Connection.open("127.0.0.1", port, client_id="t", timeout_s=1.0)
            return raised.value  # type: ignore[return-value]
        finally:
            server.close()

    raised = asyncio.run(scenario())
    if error is not None:
        assert isinstance(raised, error), raised
    assert words in str(raised)


def test_requests_wait_for_room_in_turn(kafka_broker: KafkaCluster) -> None:
    """With the buffer full, requests get room in the order they asked for it: none waits
    while a later one passes it."""
    topic = unique("sender-room")
    create(kafka_broker, topic, partitions=1)
    granted: list[int] = []

    async def scenario() -> None:
        one = chunk("x", 50)
        sender = await started(kafka_broker, buffer_bytes=3 * one.size)

        async def request(i: int) -> None:
            await sender.room(one.size, 30)
            granted.append(i)
            await sender.send(topic, 0, chunk(f"r{i}", 50))

        try:
            await asyncio.gather(*[request(i) for i in range(60)])
        finally:
            await sender.close(10)

    asyncio.run(scenario())
    assert granted == list(range(60))
    values = [m.value() for m in read_all(kafka_broker, topic, 0)]
    assert values == [b"r%d-%d" % (i, j) for i in range(60) for j in range(50)]
