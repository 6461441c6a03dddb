"""Config of the Kafka backend (``bus.kafka``)."""

from __future__ import annotations

from pydantic import Field

from headwater.config.base import Section

ClientValue = str | int | float | bool


class KafkaBusConfig(Section):
    bootstrap_servers: str = Field(
        "127.0.0.1:9092", description="Comma-separated host:port list of the Kafka brokers."
    )
    default_partitions: int = Field(2, ge=1, description="Partitions of new topics.")
    replication_factor: int = Field(
        1, ge=1, description="Replication factor of new topics (use 3 in production)."
    )
    auto_create_topics: bool = Field(
        True, description="Create a topic on its first append instead of rejecting it."
    )
    max_record_bytes: int = Field(
        1 << 20, gt=0, description="Largest record (key + value + headers) accepted."
    )
    client: dict[str, ClientValue] = Field(
        default_factory=dict,
        description="librdkafka options for every client (security.protocol, sasl.*, ...).",
    )
    producer: dict[str, ClientValue] = Field(
        default_factory=dict, description="Extra librdkafka options for the producer."
    )
    consumer: dict[str, ClientValue] = Field(
        default_factory=dict, description="Extra librdkafka options for consumers."
    )
    connector: dict[str, str] = Field(
        default_factory=dict,
        description="Extra options of Spark's Kafka connector, which the pipeline reads Kafka "
        "with: kafka.security.protocol, kafka.sasl.jaas.config, ... (Java client names).",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Timeout of admin and metadata requests, in seconds."
    )
