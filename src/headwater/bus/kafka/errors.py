"""The one place the Kafka backend decides what a Kafka error means: transient or terminal."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from headwater.bus.errors import (
    BusClosed,
    BusError,
    BusUnavailable,
    InvalidArgument,
    InvalidTopicName,
    OffsetOutOfRange,
    RecordTooLarge,
    TopicExists,
    UnknownPartition,
    UnknownTopic,
)
from headwater.errors import HeadwaterError

# librdkafka error names (``KafkaError.name()``) and the bus error each one becomes.
_TERMINAL: dict[str, type[BusError]] = {
    "MSG_SIZE_TOO_LARGE": RecordTooLarge,
    "RECORD_LIST_TOO_LARGE": RecordTooLarge,
    "UNKNOWN_TOPIC_OR_PART": UnknownTopic,
    "_UNKNOWN_TOPIC": UnknownTopic,
    "UNKNOWN_TOPIC_ID": UnknownTopic,
    "_UNKNOWN_PARTITION": UnknownPartition,
    "OFFSET_OUT_OF_RANGE": OffsetOutOfRange,
    "_AUTO_OFFSET_RESET": OffsetOutOfRange,
    "TOPIC_ALREADY_EXISTS": TopicExists,
    "TOPIC_EXCEPTION": InvalidTopicName,
    "INVALID_PARTITIONS": InvalidArgument,
    "INVALID_REPLICATION_FACTOR": InvalidArgument,
    "INVALID_REPLICA_ASSIGNMENT": InvalidArgument,
    "INVALID_CONFIG": InvalidArgument,
    "INVALID_REQUEST": InvalidArgument,
    "INVALID_RECORD": InvalidArgument,
    "POLICY_VIOLATION": InvalidArgument,
    "_INVALID_ARG": InvalidArgument,
    "_DESTROY": BusClosed,
    # Purged when the bus closed before the cluster acknowledged: the outcome is unknown.
    "_PURGE_QUEUE": BusClosed,
    "_PURGE_INFLIGHT": BusClosed,
}

# Errors that clear up by themselves: a broker restarting, a leader moving, a full queue.
_TRANSIENT = frozenset(
    {
        "_MSG_TIMED_OUT",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_TIMED_OUT",
        "_QUEUE_FULL",
        "_RESOLVE",
        "_WAIT_COORD",
        "REQUEST_TIMED_OUT",
        "NETWORK_EXCEPTION",
        "LEADER_NOT_AVAILABLE",
        "NOT_LEADER_FOR_PARTITION",
        "REPLICA_NOT_AVAILABLE",
        "NOT_ENOUGH_REPLICAS",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        "KAFKA_STORAGE_ERROR",
        "COORDINATOR_LOAD_IN_PROGRESS",
        "COORDINATOR_NOT_AVAILABLE",
        "NOT_COORDINATOR",
        "REBALANCE_IN_PROGRESS",
        "THROTTLING_QUOTA_EXCEEDED",
        "FENCED_LEADER_EPOCH",
        "UNKNOWN_LEADER_EPOCH",
    }
)


def classify(error: BaseException | Any, action: str) -> HeadwaterError:
    """The bus error for ``error`` (a ``KafkaError``, a ``KafkaException`` or a timeout) that
    happened while doing ``action`` ("appending to 'events'"). Transient errors become
    ``BusUnavailable``; everything else is terminal. Errors that are already headwater errors
    are returned unchanged."""
    if isinstance(error, HeadwaterError):
        return error
    if isinstance(error, concurrent.futures.TimeoutError | TimeoutError):
        return BusUnavailable(f"{action}: the Kafka cluster did not answer in time")
    kafka_error = error.args[0] if isinstance(error, Exception) and error.args else error
    name_of = getattr(kafka_error, "name", None)
    if not callable(name_of):
        return BusError(f"{action}: {type(error).__name__}: {error}")
    name = str(name_of())
    detail = f"{action}: {name}: {kafka_error.str()}"
    if name in _TRANSIENT:
        return BusUnavailable(detail)
    terminal = _TERMINAL.get(name)
    if terminal is not None:
        return terminal(detail)
    if not kafka_error.fatal() and kafka_error.retriable():
        return BusUnavailable(detail)
    return BusError(detail)
