"""The Kafka protocol's error codes that a producer meets, and which of them a retry clears.

Codes and names are the protocol's (``org.apache.kafka.common.protocol.Errors``); an unknown
code is terminal.
"""

from __future__ import annotations

from typing import NamedTuple


class KafkaCode(NamedTuple):
    code: int
    name: str
    retriable: bool


_CODES = [
    KafkaCode(-1, "UNKNOWN_SERVER_ERROR", False),
    KafkaCode(0, "NONE", False),
    KafkaCode(2, "CORRUPT_MESSAGE", True),
    KafkaCode(3, "UNKNOWN_TOPIC_OR_PARTITION", True),
    KafkaCode(5, "LEADER_NOT_AVAILABLE", True),
    KafkaCode(6, "NOT_LEADER_OR_FOLLOWER", True),
    KafkaCode(7, "REQUEST_TIMED_OUT", True),
    KafkaCode(8, "BROKER_NOT_AVAILABLE", False),
    KafkaCode(9, "REPLICA_NOT_AVAILABLE", True),
    KafkaCode(10, "MESSAGE_TOO_LARGE", False),
    KafkaCode(13, "NETWORK_EXCEPTION", True),
    KafkaCode(14, "COORDINATOR_LOAD_IN_PROGRESS", True),
    KafkaCode(15, "COORDINATOR_NOT_AVAILABLE", True),
    KafkaCode(16, "NOT_COORDINATOR", True),
    KafkaCode(17, "INVALID_TOPIC_EXCEPTION", False),
    KafkaCode(18, "RECORD_LIST_TOO_LARGE", False),
    KafkaCode(19, "NOT_ENOUGH_REPLICAS", True),
    KafkaCode(20, "NOT_ENOUGH_REPLICAS_AFTER_APPEND", True),
    KafkaCode(21, "INVALID_REQUIRED_ACKS", False),
    KafkaCode(29, "TOPIC_AUTHORIZATION_FAILED", False),
    KafkaCode(31, "CLUSTER_AUTHORIZATION_FAILED", False),
    KafkaCode(32, "INVALID_TIMESTAMP", False),
    KafkaCode(35, "UNSUPPORTED_VERSION", False),
    KafkaCode(42, "INVALID_REQUEST", False),
    KafkaCode(43, "UNSUPPORTED_FOR_MESSAGE_FORMAT", False),
    KafkaCode(45, "OUT_OF_ORDER_SEQUENCE_NUMBER", False),
    KafkaCode(46, "DUPLICATE_SEQUENCE_NUMBER", False),
    KafkaCode(47, "INVALID_PRODUCER_EPOCH", False),
    KafkaCode(53, "TRANSACTIONAL_ID_AUTHORIZATION_FAILED", False),
    KafkaCode(56, "KAFKA_STORAGE_ERROR", True),
    KafkaCode(59, "UNKNOWN_PRODUCER_ID", False),
    KafkaCode(74, "FENCED_LEADER_EPOCH", True),
    KafkaCode(75, "UNKNOWN_LEADER_EPOCH", True),
    KafkaCode(87, "INVALID_RECORD", False),
    KafkaCode(89, "THROTTLING_QUOTA_EXCEEDED", True),
    KafkaCode(90, "PRODUCER_FENCED", False),
    KafkaCode(100, "UNKNOWN_TOPIC_ID", True),
]
CODES = {c.code: c for c in _CODES}
NONE = 0
UNKNOWN_TOPIC_OR_PARTITION = 3
NOT_LEADER_OR_FOLLOWER = 6
NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
MESSAGE_TOO_LARGE = 10
RECORD_LIST_TOO_LARGE = 18
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
DUPLICATE_SEQUENCE_NUMBER = 46
INVALID_PRODUCER_EPOCH = 47
UNKNOWN_PRODUCER_ID = 59
PRODUCER_FENCED = 90
# What means the partition's leader is not where the producer thinks: ask for metadata again.
LEADER_MOVED = frozenset({3, 5, 6, 74, 75, 100})


def code(number: int) -> KafkaCode:
    """The error ``number``; an unknown one is terminal and named by its number."""
    return CODES.get(number) or KafkaCode(number, f"ERROR_{number}", False)
