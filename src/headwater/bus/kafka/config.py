"""Config of the Kafka backend (``bus.kafka``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
        30.0, gt=0, description="Timeout of admin, metadata and produce requests, in seconds."
    )
    producer_client: Literal["auto", "headwater", "librdkafka"] = Field(
        "auto",
        description="What appends with: headwater's own producer (a request's events in one "
        "call and one answer; PLAINTEXT only) or librdkafka (confluent-kafka's, which also "
        "speaks TLS and SASL through `client`); auto: headwater's unless "
        "client.security.protocol asks for more than PLAINTEXT.",
    )
    delivery_timeout_s: float = Field(
        120.0,
        gt=0,
        description="headwater's producer: how long an append may take, retries included, "
        "before it fails (the client is not acked and sends again).",
    )
    max_in_flight: int = Field(
        2,
        ge=1,
        le=5,
        description="headwater's producer: produce requests in flight per broker connection "
        "(fewer: larger batches; idempotence keeps order up to 5).",
    )
    batch_bytes: int = Field(
        1_000_000,
        ge=16_384,
        description="headwater's producer: the largest record batch it makes per partition "
        "(keep below the topic's max.message.bytes).",
    )
    buffer_bytes: int = Field(
        64 << 20,
        ge=16_384,
        description="headwater's producer: unacknowledged bytes it holds before requests wait "
        "for room (then 503 with Retry-After).",
    )

    compression: Literal["none", "lz4"] = Field(
        "lz4",
        description="headwater's producer: how record batches travel and are stored. lz4: a "
        "request's records repeat their header names and context, and compress several "
        "times over, for a fraction of a microsecond an event.",
    )

    @model_validator(mode="after")
    def _plaintext_for_headwater(self) -> KafkaBusConfig:
        if self.producer_client == "headwater" and self._secured:
            raise ValueError(
                "producer_client: headwater's producer speaks PLAINTEXT only, and "
                f"client.security.protocol is {self.client['security.protocol']!r}; "
                "set producer_client: librdkafka (or auto)"
            )
        return self

    @property
    def _secured(self) -> bool:
        return str(self.client.get("security.protocol", "plaintext")).lower() != "plaintext"

    @property
    def own_producer(self) -> bool:
        """Whether appends go through headwater's producer (``bus.kafka.sender``)."""
        return self.producer_client == "headwater" or (
            self.producer_client == "auto" and not self._secured
        )
