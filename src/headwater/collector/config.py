"""Config of the collector (``collector`` in ``headwater.yaml``)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from headwater.config.base import Section, require_unique_ids

MiB = 1 << 20


class RaccoonConfig(Section):
    auth: Literal["open", "keyed"] = Field(
        "open",
        description="open: anyone may send; keyed: a source's write key is required "
        "(Authorization Basic/Bearer or X-Write-Key).",
    )
    identity_header: str = Field(
        "X-User-ID", description="Header naming the client a connection belongs to."
    )
    group_header: str | None = Field(
        None, description="Optional header that, with the identity, names a connection's group."
    )
    max_connections: int = Field(30_000, ge=1, description="WebSocket connections in total.")
    max_connections_per_identity: int = Field(
        1, ge=1, description="WebSocket connections per identity (and group)."
    )
    ping_interval_s: float = Field(30.0, gt=0, description="How often the server pings.")
    pong_wait_s: float = Field(
        60.0, gt=0, description="Close a connection that has not answered a ping by then."
    )
    read_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Close a connection that sends nothing (not even a pong) for this long; "
        "0 uses pong_wait_s.",
    )
    topic_pattern: str = Field(
        "clickstream-{type}-log",
        description="Topic of an event by its type: {type} (or Raccoon's %s) is replaced.",
    )
    dedup_window: int = Field(
        1024, ge=0, description="Request ids remembered per connection to drop repeats."
    )

    @field_validator("topic_pattern")
    @classmethod
    def _one_placeholder(cls, v: str) -> str:
        if v.count("{type}") + v.count("%s") != 1:
            raise ValueError("must contain exactly one {type} (or %s)")
        return v.replace("%s", "{type}")


def _hashed(keys: list[str]) -> list[str]:
    for k in keys:
        digest = k.removeprefix("sha256:")
        if not k.startswith("sha256:") or len(digest) != 64 or not _is_hex(digest):
            raise ValueError(
                "write keys are stored hashed: give sha256:<64 hex digits> "
                "(from `headwater hash-key KEY`), not the key itself"
            )
    return [k.lower() for k in keys]


# Write keys as the config stores them: hashed (every source of events: collector, webhooks)
HashedKeys = Annotated[list[str], AfterValidator(_hashed)]


class SourceConfig(Section):
    id: str = Field(
        ...,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name of the source; stored with every event it sends.",
    )
    write_keys: HashedKeys = Field(
        default_factory=list,
        description="SHA-256 hashes of the source's write keys, as sha256:<64 hex> "
        "(make one with `headwater hash-key`).",
    )
    topic_pattern: str | None = Field(
        None, description="Topic of this source's JSON events; default collector.topic_pattern."
    )


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


class LimitsConfig(Section):
    max_body_bytes: int = Field(
        5 * MiB, gt=0, description="Largest HTTP body accepted (after gzip decompression)."
    )
    max_frame_bytes: int = Field(5 * MiB, gt=0, description="Largest WebSocket message accepted.")
    max_batch_events: int = Field(10_000, gt=0, description="Most events in one request.")
    request_timeout_s: float = Field(
        30.0, gt=0, description="A client must send a whole request within this time."
    )


class AdmissionConfig(Section):
    min_free_disk_bytes: int | None = Field(
        512 * MiB,
        ge=0,
        description="Refuse events while the embedded log's disk has less free space than this.",
    )
    max_lag_records: int | None = Field(
        None, ge=0, description="Refuse events while a writer lags more records than this."
    )
    check_interval_s: float = Field(1.0, gt=0, description="How often the budgets are checked.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After given with a refusal.")


class StatsdConfig(Section):
    host: str = Field("127.0.0.1", description="StatsD host.")
    port: int = Field(8125, ge=1, le=65535, description="StatsD UDP port.")
    prefix: str = Field("headwater.collector", description="Prefix of every metric name.")
    interval_s: float = Field(10.0, gt=0, description="How often counters are sent.")


class TlsConfig(Section):
    cert_file: Path = Field(
        ..., description="PEM file of the server's certificate, then its intermediate chain."
    )
    key_file: Path = Field(
        ..., description="PEM file of the certificate's private key (unencrypted)."
    )


class CollectorConfig(Section):
    host: str = Field("127.0.0.1", description="Address the HTTP/WebSocket server binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP/WebSocket server.")
    grpc_port: int | None = Field(
        8081, ge=0, le=65535, description="Port of the gRPC server; null disables it."
    )
    tls: TlsConfig | None = Field(
        None,
        description="Serve TLS on both ports (HTTP and WebSocket, gRPC with ALPN h2); SIGHUP "
        "reloads the certificate; null: plain TCP.",
    )
    ack: Literal["durable", "received"] = Field(
        "durable",
        description="durable: acknowledge once the batch is durable on the log; "
        "received: once it is decoded (as Raccoon does).",
    )
    topic_pattern: str = Field(
        "events-{type}",
        description="Topic of events from the JSON APIs (Segment, Jitsu, OTLP) by type.",
    )
    raccoon: RaccoonConfig = Field(
        default_factory=RaccoonConfig, description="The Raccoon-compatible intake."
    )
    sources: list[SourceConfig] = Field(
        default_factory=list, description="Who may send, each with its write keys."
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses/networks whose X-Forwarded-For is believed for the client IP.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="When to refuse events (backpressure)."
    )
    statsd: StatsdConfig | None = Field(None, description="Send metrics to StatsD too.")
    shutdown_grace_s: float = Field(
        30.0, gt=0, description="How long in-flight requests may take to finish on shutdown."
    )
    workers: int | Literal["auto"] = Field(
        "auto",
        description="Intake processes serving the ports together (SO_REUSEPORT), appending "
        "through the process that holds the log; auto: one per core, at most 4; 1: the intake "
        "runs in the main process.",
    )

    share_grpc_calls: Literal["auto", "always", "never"] = Field(
        "auto",
        description="With several intake workers, a worker serving more gRPC calls than a "
        "sibling hands it some, so one HTTP/2 connection's calls use more than one core. auto: "
        "while the machine has a spare core to use (handing a call costs CPU of its own); "
        "always; never: a connection's calls are all served by the worker that accepted it.",
    )

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError("must be between 1 and 64, or auto")
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not an IP address or network") from None
        return v

    @field_validator("topic_pattern")
    @classmethod
    def _one_placeholder(cls, v: str) -> str:
        if v.count("{type}") != 1:
            raise ValueError("must contain exactly one {type}")
        return v

    @model_validator(mode="after")
    def _unique_sources(self) -> CollectorConfig:
        require_unique_ids(self.sources, "source id {!r} appears twice")
        return self
