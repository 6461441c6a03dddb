"""Config of the webhook transport (``webhooks`` in ``headwater.yaml``): the receivers webhooks
are delivered to, the sources (senders) that post them, and where the state is kept."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from headwater.collector.config import HashedKeys
from headwater.config.base import Section
from headwater.webhooks.signing import SignatureError, decode_secret

# Svix's schedule: after the first attempt, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h
SVIX_RETRY_SCHEDULE_S = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
NAME_PATTERN = r"^[A-Za-z0-9._-]+$"  # receivers name topics: to_receiver.<name>


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"must be an http(s) URL, not {url!r}")
    return url


def _secrets(value: str | list[str]) -> list[str]:
    secrets = [value] if isinstance(value, str) else list(value)
    for s in secrets:
        try:
            decode_secret(s)
        except SignatureError as e:
            raise ValueError(e.message) from None
    return secrets


class RateLimit(Section):
    requests: int = Field(gt=0, description="Requests allowed per window.")
    per_s: float = Field(1.0, gt=0, description="The window, in seconds.")


class ReceiverConfig(Section):
    name: str = Field(min_length=1, max_length=100, pattern=NAME_PATTERN)
    url: str = Field(description="Where messages are POSTed.")
    status_url: str | None = Field(
        None,
        description="GET for a message's status and result, with {message_id}: polled for "
        "asynchronous results, and asked before resending after an ambiguous failure.",
    )
    secret: list[str] = Field(
        description="whsec_ secret(s) signing every request; during a rotation list the new one "
        "first and the old one after it: both sign until the old one is removed.",
        min_length=1,
    )
    rate_limit: RateLimit | None = Field(None, description="Most requests per window.")
    timeout_s: float = Field(15.0, gt=0, description="How long one request may take.")
    retry_schedule_s: list[float] = Field(
        default_factory=lambda: list(SVIX_RETRY_SCHEDULE_S),
        description="Waits before each retry after the first attempt (default: Svix's).",
    )
    ttl_s: float = Field(3600.0, gt=0, description="How long an asynchronous result may take.")
    ordered: bool = Field(False, description="Strict FIFO: a failing message blocks the rest.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _http_url(v)

    @field_validator("secret", mode="before")
    @classmethod
    def _secret(cls, v: str | list[str]) -> list[str]:
        return _secrets(v)

    @field_validator("status_url")
    @classmethod
    def _status(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if "{message_id}" not in v:
            raise ValueError("must contain {message_id}")
        return _http_url(v)

    @field_validator("retry_schedule_s")
    @classmethod
    def _schedule(cls, v: list[float]) -> list[float]:
        if any(s < 0 for s in v):
            raise ValueError("waits cannot be negative")
        return v


class WebhookSourceConfig(Section):
    id: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    write_keys: HashedKeys = Field(
        default_factory=list, description="SHA-256 hashes of the source's keys (sha256:<hex>)."
    )
    callback_url: str | None = Field(
        None, description="Where receivers' responses are POSTed back (none: not sent back)."
    )
    secret: list[str] = Field(
        default_factory=list, description="whsec_ secret(s) signing the callbacks."
    )

    @field_validator("callback_url")
    @classmethod
    def _callback(cls, v: str | None) -> str | None:
        return v if v is None else _http_url(v)

    @field_validator("secret", mode="before")
    @classmethod
    def _secret(cls, v: str | list[str]) -> list[str]:
        return _secrets(v)

    @model_validator(mode="after")
    def _signed_callbacks(self) -> WebhookSourceConfig:
        if self.callback_url is not None and not self.secret:
            raise ValueError(f"source {self.id}: a callback_url needs a secret to sign with")
        return self


class WebhookStateConfig(Section):
    backend: Literal["embedded", "redis"] = Field(
        "embedded", description="embedded: SQLite under data_dir (one machine); redis: shared."
    )
    path: Path | None = Field(None, description="embedded: the file (default data_dir/webhooks).")
    redis_url: str | None = Field(None, description="redis: redis://host:port/db.")
    redis_prefix: str = Field(
        "headwater:webhooks:", min_length=1, description="redis: the prefix of every key."
    )

    @model_validator(mode="after")
    def _redis_needs_url(self) -> WebhookStateConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("webhooks.state.backend redis needs webhooks.state.redis_url")
        return self


class WebhooksConfig(Section):
    host: str = Field("127.0.0.1", description="Where `headwater webhooks` serves /healthz.")
    port: int = Field(8090, ge=0, le=65535, description="Its port (0: any free port).")
    receivers: list[ReceiverConfig] = Field(default_factory=list)
    sources: list[WebhookSourceConfig] = Field(default_factory=list)
    state: WebhookStateConfig = Field(default_factory=WebhookStateConfig)
    max_payload_bytes: int = Field(
        1 << 20, gt=0, description="Largest message body accepted at intake."
    )
    topic_prefix: str = Field(
        "webhooks.",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Prefix of the webhook topics (and of the workers' consumer groups).",
    )
    retention_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="How long a DONE message is kept (status, attempts; and the dedup of its "
        "id). FAILED ones stay until retried.",
    )
    claim_lease_s: float = Field(
        60.0,
        gt=0,
        description="How long a due retry, poll or callback stays with the worker that took it; "
        "if that worker stops, another takes it after this.",
    )
    concurrency: int = Field(
        256, gt=0, description="Messages a worker process handles at once per topic."
    )

    @model_validator(mode="after")
    def _unique(self) -> WebhooksConfig:
        for what, names in (
            ("receiver", [r.name for r in self.receivers]),
            ("source", [s.id for s in self.sources]),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"webhooks: {what} names must be unique: {', '.join(twice)}")
        return self

    # the lookups by name, made once: the workers look a message's receiver and source up
    # several times a message (a private attribute, read through pydantic's ``__getattr__``,
    # took 2.7 us a lookup; this, 0.16)
    @cached_property
    def receivers_by_name(self) -> dict[str, ReceiverConfig]:
        return {r.name: r for r in self.receivers}

    @cached_property
    def sources_by_id(self) -> dict[str, WebhookSourceConfig]:
        return {s.id: s for s in self.sources}

    def receiver(self, name: str) -> ReceiverConfig | None:
        return self.receivers_by_name.get(name)

    def source(self, source_id: str) -> WebhookSourceConfig | None:
        return self.sources_by_id.get(source_id)
