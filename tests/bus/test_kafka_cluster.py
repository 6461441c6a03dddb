"""The Kafka backend on a three-broker Apache Kafka cluster (replication factor 3,
``min.insync.replicas`` 2): an append acknowledged before a broker is SIGKILLed is readable
after, appends go on with one broker down, are refused (and never acknowledged) with two down,
and go on again once a broker is back; nothing acknowledged is lost or stored twice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from headwater.bus import open_bus
from headwater.bus.errors import BusUnavailable
from headwater.bus.kafka.backend import KafkaBus
from headwater.bus.records import Message
from headwater.config.model import HeadwaterConfig
from headwater.testing.kafka import KafkaCluster, start_kafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(600)]
TOPIC = "events-cluster"
WAIT_S = 60.0


# Kafka notices a dead broker after broker.session.timeout.ms (9 s) and drops a silent replica
# from the in-sync set after replica.lag.time.max.ms (30 s): shorter here, to keep the test short
FAST_FAILOVER = {
    "broker.session.timeout.ms": "4000",
    "broker.heartbeat.interval.ms": "1000",
    "replica.lag.time.max.ms": "5000",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaCluster]:
    with start_kafka(brokers=3, settings=FAST_FAILOVER) as kafka:
        yield kafka


def open_kafka(cluster: KafkaCluster, message_timeout_ms: int = 30_000) -> KafkaBus:
    config = HeadwaterConfig.model_validate(
        {
            "bus": {
                "backend": "kafka",
                "kafka": {
                    "bootstrap_servers": cluster.bootstrap_servers,
                    "replication_factor": 3,
                    "timeout_s": 30.0,
                    "delivery_timeout_s": message_timeout_ms / 1000,
                },
            }
        }
    )
    bus = open_bus(config)
    assert isinstance(bus, KafkaBus)
    return bus


def batch(start: int, n: int = 50) -> list[Message]:
    return [Message(b"event-%d" % i) for i in range(start, start + n)]


def values(bus: KafkaBus) -> list[bytes]:
    low, high = bus.watermarks(TOPIC, 0)
    out: list[bytes] = []
    offset = low
    while offset < high:
        records = bus.read(TOPIC, 0, offset, max_records=1000)
        out += [r.value for r in records]
        offset = records[-1].offset + 1
    return out


def test_acked_appends_survive_broker_kills_and_min_isr_refuses_the_rest(
    cluster: KafkaCluster,
) -> None:
    bus = open_kafka(cluster)
    info = bus.create_topic(TOPIC, partitions=1)
    assert info.replication_factor == 3
    acked: list[bytes] = []

    def append(start: int) -> None:
        bus.append(TOPIC, batch(start)).result(timeout=WAIT_S)
        acked.extend(m.value for m in batch(start))

    append(0)
    cluster.kill(0)  # one broker gone: 2 replicas in sync, enough for min.insync.replicas=2
    append(50)
    append(100)

    cluster.kill(1)  # two gone: the last broker refuses acks=all, nothing is acknowledged
    refusing = open_kafka(cluster, message_timeout_ms=5_000)
    try:
        error = refusing.append(TOPIC, batch(1_000)).exception(timeout=WAIT_S)
        assert isinstance(error, BusUnavailable), error
        assert error.transient
    finally:
        refusing.close()

    cluster.restart(1)
    append(150)  # back to two in sync: appends are acknowledged again
    cluster.restart(0)
    append(200)
    bus.close()

    with open_kafka(cluster) as reader:
        stored = values(reader)
    assert len(stored) == len(set(stored)), "a record is stored twice"
    assert set(acked) <= set(stored), "an acknowledged record is missing"
    assert [v for v in stored if v in set(acked)] == acked, "acknowledged records out of order"
