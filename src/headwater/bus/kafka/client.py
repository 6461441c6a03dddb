"""The confluent-kafka clients of the Kafka backend: lazy import and librdkafka settings."""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

from headwater.bus.kafka.config import ClientValue, KafkaBusConfig
from headwater.errors import MissingDependencyError

# Room for the record framing and batch header on top of the largest record we accept.
_FRAMING_BYTES = 64 * 1024
# Kafka's default limit of a record batch (the broker's message.max.bytes).
KAFKA_DEFAULT_BATCH_BYTES = 1_048_588


def max_batch_bytes(config: KafkaBusConfig) -> int:
    """The largest record batch: holds the largest record headwater accepts."""
    return max(KAFKA_DEFAULT_BATCH_BYTES, config.max_record_bytes + _FRAMING_BYTES)


def topic_settings(config: KafkaBusConfig) -> dict[str, str]:
    """Topic configs of the topics headwater creates: a larger batch limit where
    ``max_record_bytes`` needs one, else the cluster's defaults."""
    limit = max_batch_bytes(config)
    return {"max.message.bytes": str(limit)} if limit > KAFKA_DEFAULT_BATCH_BYTES else {}


def load_kafka() -> ModuleType:
    """``confluent_kafka``, imported on first use with an install hint when missing."""
    try:
        import confluent_kafka
    except ImportError as exc:
        raise MissingDependencyError("confluent_kafka", "kafka") from exc
    return confluent_kafka


def load_admin() -> ModuleType:
    load_kafka()
    import confluent_kafka.admin

    return confluent_kafka.admin


def _common(config: KafkaBusConfig) -> dict[str, ClientValue]:
    return {"bootstrap.servers": config.bootstrap_servers, **config.client}


def admin_settings(config: KafkaBusConfig) -> dict[str, Any]:
    return _common(config)


def producer_settings(config: KafkaBusConfig) -> dict[str, Any]:
    """Durable producing: every in-sync replica acks, and retries never duplicate or reorder."""
    return {
        **_common(config),
        "linger.ms": 2,
        "message.max.bytes": max_batch_bytes(config),
        # headwater decides which topics exist (with its partition count), never the broker.
        "allow.auto.create.topics": False,
        **config.producer,
        "acks": "all",
        "enable.idempotence": True,
    }


def consumer_settings(config: KafkaBusConfig, group: str) -> dict[str, Any]:
    """A consumer of ``group`` that commits only when told to."""
    fetch = max(52_428_800, max_batch_bytes(config))
    return {
        **_common(config),
        "auto.offset.reset": "earliest",
        "fetch.max.bytes": fetch,
        "max.partition.fetch.bytes": max_batch_bytes(config),
        "receive.message.max.bytes": max(100_000_000, fetch + 512),
        **config.consumer,
        "group.id": group,
        "enable.auto.commit": False,
        "allow.auto.create.topics": False,
    }


def reader_settings(config: KafkaBusConfig) -> dict[str, Any]:
    """The consumer behind ``read()``: assigned partitions only, never joins or commits a group
    (librdkafka requires a group id; an unused one leaves no trace on the broker)."""
    settings = consumer_settings(config, f"headwater.reader.{uuid.uuid4().hex}")
    settings.update(
        {
            "auto.offset.reset": "error",
            "enable.partition.eof": True,
            "enable.auto.offset.store": False,
            # read() waits for the end of the partition: do not let the broker hold the fetch.
            "fetch.wait.max.ms": 10,
        }
    )
    return settings
