"""What only the Kafka backend does: librdkafka settings, error classification, delivery
failures, and the agreement of its partitioning and records with plain Kafka clients."""

from __future__ import annotations

import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from headwater.bus import open_bus
from headwater.bus.errors import (
    BusClosed,
    BusError,
    BusUnavailable,
    InvalidArgument,
    InvalidTopicName,
    OffsetOutOfRange,
    QueueFull,
    RecordTooLarge,
    TopicExists,
    UnknownPartition,
    UnknownTopic,
)
from headwater.bus.kafka.backend import KafkaBus
from headwater.bus.kafka.client import (
    consumer_settings,
    load_kafka,
    producer_settings,
    reader_settings,
    topic_settings,
)
from headwater.bus.kafka.config import KafkaBusConfig
from headwater.bus.kafka.errors import classify
from headwater.bus.records import Message, TopicPartition
from headwater.config.model import HeadwaterConfig
from headwater.errors import MissingDependencyError
from headwater.testing.kafka import KafkaCluster, start_kafka
from headwater.testing.ports import free_port
from headwater.testing.waiting import wait_until

ck = pytest.importorskip("confluent_kafka")
WAIT_S = 30.0


def kafka_config(bootstrap: str, **kafka: Any) -> HeadwaterConfig:
    section = {
        "bootstrap_servers": bootstrap,
        "consumer": {"session.timeout.ms": 6000},
        "timeout_s": 15.0,
        **kafka,
    }
    return HeadwaterConfig.model_validate({"bus": {"backend": "kafka", "kafka": section}})


@pytest.fixture
def kafka_bus(kafka_broker: KafkaCluster) -> Iterator[KafkaBus]:
    bus = open_bus(kafka_config(kafka_broker.bootstrap_servers))
    assert isinstance(bus, KafkaBus)
    yield bus
    bus.close()


def name(base: str) -> str:
    return f"{base}-{uuid.uuid4().hex[:10]}"


# -- no broker needed ---------------------------------------------------------------------


def test_missing_confluent_kafka_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)
    with pytest.raises(MissingDependencyError) as info:
        load_kafka()
    assert info.value.extra == "kafka"
    assert "pip install 'headwater[kafka]'" in str(info.value)
    with pytest.raises(MissingDependencyError):
        KafkaBus(KafkaBusConfig())


def test_producer_is_always_durable_and_idempotent() -> None:
    config = KafkaBusConfig(
        producer={"acks": "1", "enable.idempotence": False, "linger.ms": 20},
        max_record_bytes=4_000_000,
    )
    settings = producer_settings(config)
    assert settings["acks"] == "all"
    assert settings["enable.idempotence"] is True
    assert settings["linger.ms"] == 20  # other options are the operator's
    assert settings["message.max.bytes"] > 4_000_000


def test_consumers_never_commit_on_their_own() -> None:
    config = KafkaBusConfig(consumer={"enable.auto.commit": True, "group.id": "sneaky"})
    settings = consumer_settings(config, "writer")
    assert settings["enable.auto.commit"] is False
    assert settings["group.id"] == "writer"
    reader = reader_settings(config)
    assert reader["enable.auto.commit"] is False
    assert reader["group.id"] != reader_settings(config)["group.id"]


@pytest.mark.parametrize("max_record_bytes", [1024, 1 << 20, 200_000_000])
def test_librdkafka_accepts_the_settings(max_record_bytes: int) -> None:
    config = KafkaBusConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}", max_record_bytes=max_record_bytes
    )
    ck.Consumer(consumer_settings(config, "writer")).close()
    ck.Consumer(reader_settings(config)).close()
    producer = ck.Producer(producer_settings(config))
    assert producer.flush(0) == 0
    assert producer_settings(config)["message.max.bytes"] > max_record_bytes


def test_topics_created_accept_the_largest_record() -> None:
    assert topic_settings(KafkaBusConfig(max_record_bytes=1000)) == {}  # Kafka's default fits
    limit = int(topic_settings(KafkaBusConfig(max_record_bytes=5_000_000))["max.message.bytes"])
    assert limit > 5_000_000


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("_MSG_TIMED_OUT", BusUnavailable),
        ("_TRANSPORT", BusUnavailable),
        ("_ALL_BROKERS_DOWN", BusUnavailable),
        ("NOT_ENOUGH_REPLICAS", BusUnavailable),
        ("NOT_LEADER_FOR_PARTITION", BusUnavailable),
        ("REQUEST_TIMED_OUT", BusUnavailable),
        ("MSG_SIZE_TOO_LARGE", RecordTooLarge),
        ("UNKNOWN_TOPIC_OR_PART", UnknownTopic),
        ("_UNKNOWN_PARTITION", UnknownPartition),
        ("OFFSET_OUT_OF_RANGE", OffsetOutOfRange),
        ("TOPIC_ALREADY_EXISTS", TopicExists),
        ("TOPIC_EXCEPTION", InvalidTopicName),
        ("INVALID_REPLICATION_FACTOR", InvalidArgument),
        ("_PURGE_QUEUE", BusClosed),
        ("TOPIC_AUTHORIZATION_FAILED", BusError),
        ("_FATAL", BusError),
    ],
)
def test_classify_decides_transient_or_terminal(code: str, expected: type[BusError]) -> None:
    error = ck.KafkaError(getattr(ck.KafkaError, code))
    for raised in (error, ck.KafkaException(error)):
        result = classify(raised, "appending to 'events'")
        assert type(result) is expected
        assert result.transient is (expected is BusUnavailable)
        assert "appending to 'events'" in result.message
        assert code in result.message


def test_classify_other_errors() -> None:
    assert isinstance(classify(TimeoutError(), "listing topics"), BusUnavailable)
    already = UnknownTopic("gone")
    assert classify(already, "reading") is already
    odd = classify(ValueError("strange"), "reading")
    assert type(odd) is BusError
    assert not odd.transient
    assert "strange" in odd.message


# -- against Apache Kafka ----------------------------------------------------------------


@pytest.mark.kafka
def test_registered_as_the_kafka_backend(kafka_bus: KafkaBus) -> None:
    assert kafka_bus.backend == "kafka"


@pytest.mark.kafka
def test_keyed_partitions_match_librdkafkas_consistent_partitioner(
    kafka_bus: KafkaBus, kafka_broker: KafkaCluster
) -> None:
    topic = name("agree")
    kafka_bus.create_topic(topic, partitions=5)
    keys = [f"device-{i}".encode() for i in range(25)]
    ours = kafka_bus.append(topic, [Message(b"x", key=k) for k in keys]).result(WAIT_S)

    theirs: dict[bytes, int] = {}
    producer = ck.Producer(
        {"bootstrap.servers": kafka_broker.bootstrap_servers, "partitioner": "consistent"}
    )

    def delivered(error: Any, message: Any) -> None:
        theirs[message.key()] = message.partition()

    for key in keys:
        producer.produce(topic, b"y", key=key, on_delivery=delivered)
    assert producer.flush(WAIT_S) == 0
    assert [p.partition for p in ours] == [theirs[k] for k in keys]
    assert [p.partition for p in ours] == [zlib.crc32(k) % 5 for k in keys]


@pytest.mark.kafka
def test_records_of_other_producers_read_back_with_empty_nulls(
    kafka_bus: KafkaBus, kafka_broker: KafkaCluster
) -> None:
    topic = name("foreign")
    kafka_bus.create_topic(topic, partitions=1)
    producer = ck.Producer({"bootstrap.servers": kafka_broker.bootstrap_servers})
    producer.produce(topic, None, key=b"deleted", headers=[("null", None)], partition=0)
    assert producer.flush(WAIT_S) == 0
    (record,) = kafka_bus.read(topic, 0, 0)
    assert record.key == b"deleted"
    assert record.value == b""
    assert record.headers == (("null", b""),)


@pytest.mark.kafka
def test_records_above_librdkafkas_default_size(kafka_broker: KafkaCluster) -> None:
    config = kafka_config(kafka_broker.bootstrap_servers, max_record_bytes=3_000_000)
    with open_bus(config) as bus:
        topic = name("big")
        bus.create_topic(topic, partitions=1)
        value = bytes(range(256)) * 10_000  # 2.56 MB
        assert bus.append(topic, [Message(value)]).result(WAIT_S)[0].offset == 0
        (record,) = bus.read(topic, 0, 0)
        assert record.value == value


@pytest.mark.kafka
def test_compact_is_left_to_the_broker(kafka_bus: KafkaBus) -> None:
    topic = name("compact")
    kafka_bus.create_topic(topic, partitions=1)
    assert kafka_bus.compact(topic) == []
    assert kafka_bus.compact() == []
    with pytest.raises(UnknownTopic):
        kafka_bus.compact(name("missing"))


@pytest.mark.kafka
def test_replication_factor_beyond_the_cluster(kafka_bus: KafkaBus) -> None:
    with pytest.raises(InvalidArgument, match="replication"):
        kafka_bus.create_topic(name("replicas"), partitions=1, replication_factor=3)


@pytest.mark.kafka
def test_seek_before_the_group_assigns_the_partition(kafka_bus: KafkaBus) -> None:
    topic, group = name("early-seek"), name("writer")
    kafka_bus.create_topic(topic, partitions=1)
    kafka_bus.append(topic, [Message(f"r{i}".encode()) for i in range(5)]).result(WAIT_S)
    with kafka_bus.consumer(group, [topic]) as consumer:
        consumer.seek(TopicPartition(topic, 0), 3)  # not assigned yet: applied on assignment
        records: list[int] = []
        deadline = time.monotonic() + WAIT_S
        while len(records) < 2 and time.monotonic() < deadline:
            records += [r.offset for r in consumer.poll(timeout=0.5)]
        assert records == [3, 4]


@pytest.mark.kafka
def test_consumer_of_an_unknown_topic(kafka_bus: KafkaBus) -> None:
    with pytest.raises(UnknownTopic):
        kafka_bus.consumer(name("writer"), [name("missing")])


# Each producer's settings for a short delivery timeout (and, for librdkafka, a queue of 3)
SHORT_TIMEOUT = {
    "headwater": {"delivery_timeout_s": 1.5},
    "librdkafka": {"producer": {"message.timeout.ms": 1500, "queue.buffering.max.messages": 3}},
}
LONG_TIMEOUT = {
    "headwater": {"delivery_timeout_s": 120},
    "librdkafka": {"producer": {"message.timeout.ms": 120_000}},
}


@pytest.mark.kafka
@pytest.mark.parametrize("client", ["headwater", "librdkafka"])
def test_append_fails_its_future_when_the_broker_is_gone(client: str) -> None:
    with start_kafka() as broker:
        config = kafka_config(
            broker.bootstrap_servers, producer_client=client, timeout_s=3.0, **SHORT_TIMEOUT[client]
        )
        bus = open_bus(config)
        topic = name("outage")
        bus.create_topic(topic, partitions=1)
        bus.append(topic, [Message(b"before")]).result(WAIT_S)
        bus.flush(WAIT_S)  # librdkafka counts a message until its report is served, not resolved
        broker.process.kill()
        broker.process.wait()
        # (librdkafka: more than its queue holds, so the append waits for room, then gives up)
        during = [Message(b"during %d" % i) for i in range(5)]

        def appended() -> Any:
            try:
                return bus.append(topic, during)
            except QueueFull:  # librdkafka counts the kill's error events until they are served
                return None

        future = wait_until(appended, "an append the producer's queue takes", WAIT_S)
        error = future.exception(timeout=WAIT_S)
        assert isinstance(error, BusUnavailable)
        assert error.transient
        assert "appending to" in error.message
        bus.close()


@pytest.mark.kafka
@pytest.mark.parametrize("client", ["headwater", "librdkafka"])
def test_close_fails_what_the_broker_never_acknowledged(client: str) -> None:
    with start_kafka() as broker:
        config = kafka_config(
            broker.bootstrap_servers, producer_client=client, timeout_s=1.0, **LONG_TIMEOUT[client]
        )
        bus = open_bus(config)
        topic = name("unacked")
        bus.create_topic(topic, partitions=1)
        bus.append(topic, [Message(b"before")]).result(WAIT_S)
        broker.process.kill()
        broker.process.wait()
        future = bus.append(topic, [Message(b"lost?")])
        bus.close()
        assert isinstance(future.exception(timeout=WAIT_S), BusClosed)


def test_the_producer_follows_the_security_protocol() -> None:
    plain = kafka_config("127.0.0.1:9092").bus.kafka
    assert plain.producer_client == "auto" and plain.own_producer
    secured = kafka_config("127.0.0.1:9092", client={"security.protocol": "SASL_SSL"}).bus.kafka
    assert not secured.own_producer  # auto: librdkafka speaks TLS and SASL
    with pytest.raises(ValueError, match=r"PLAINTEXT only.*SASL_SSL.*librdkafka"):
        kafka_config(
            "127.0.0.1:9092", client={"security.protocol": "SASL_SSL"}, producer_client="headwater"
        )
