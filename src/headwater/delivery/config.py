"""Settings of an ``http`` destination (``options`` of a ``type: http`` entry under
``pipeline.destinations``)."""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from headwater.config.base import Section

ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class RetryConfig(Section):
    """dataset-go's and the OpenTelemetry exporter helper's numbers by default."""

    initial_s: float = Field(5.0, gt=0, description="Wait before the first retry.")
    multiplier: float = Field(1.5, ge=1, description="Each wait is this much longer.")
    max_interval_s: float = Field(30.0, gt=0, description="Longest wait between tries.")
    max_elapsed_s: float = Field(
        300.0, gt=0, description="After this long, a batch's events go to the failed store."
    )
    jitter: float = Field(0.2, ge=0, lt=1, description="Each wait varies by +- this share.")


class HttpDeliveryConfig(Section):
    url: str = Field(description="Where batches are sent.")
    method: Literal["POST", "PUT"] = "POST"
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra headers; ${NAME} in a value is read from the environment (and "
        "never logged).",
    )
    format: Literal["dataset", "ndjson", "json"] = Field(
        "ndjson",
        description="dataset: DataSet's addEvents body (session, sessionInfo, events); "
        "ndjson: one event per line; json: an array of events.",
    )
    compression: Literal["gzip", "none"] = "gzip"
    compression_level: int = Field(
        1,
        ge=1,
        le=9,
        description="gzip's level: 1-3 by ISA-L (level 1 ~5x zlib's speed, a little smaller), "
        "4-9 by zlib (smaller, slower).",
    )
    group_by: list[str] = Field(
        default_factory=list,
        description="JSON paths (/user_id) whose values make the session key; none: one "
        "session per task.",
    )
    session_info: dict[str, str] = Field(
        default_factory=dict, description="dataset: the sessionInfo of every request."
    )
    max_batch_bytes: int = Field(
        6_000_000, gt=0, description="Largest request body before compression."
    )
    max_pending_bytes: int = Field(
        64_000_000,
        gt=0,
        description="Bytes of batches a task may hold waiting or in flight (at least two "
        "batches' worth) before it stops reading its input: the events wait on the log.",
    )
    max_lifetime_s: float = Field(5.0, gt=0, description="Oldest a buffer gets before sending.")
    max_parallel_sessions: int = Field(64, gt=0, description="Sessions sending at once, per task.")
    timeout_s: float = Field(30.0, gt=0, description="How long one request may take.")
    retry: RetryConfig = Field(default_factory=RetryConfig)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"must be an http(s) URL, not {v!r}")
        return v

    @field_validator("group_by")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.strip("/"):
                raise ValueError(f"{path!r} names no field")
        return v

    def resolved_headers(self) -> dict[str, str]:
        """The headers with their ``${NAME}`` references read from the environment; a missing
        variable is named in the error (its would-be value never is)."""
        out = {}
        for name, value in self.headers.items():

            def read(match: re.Match[str], header: str = name) -> str:
                var = match.group(1)
                if var not in os.environ:
                    raise ValueError(
                        f"header {header!r} needs the environment variable {var}, which is not set"
                    )
                return os.environ[var]

            out[name] = ENV_REFERENCE.sub(read, value)
        return out
