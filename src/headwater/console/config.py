"""The ``console`` section of ``headwater.yaml``."""

from __future__ import annotations

from pydantic import Field

from headwater.collector.config import HashedKeys, TlsConfig
from headwater.config.base import Section


class ConsoleConfig(Section):
    host: str = Field("127.0.0.1", description="Where the console listens (loopback by default).")
    port: int = Field(8070, ge=0, le=65535, description="Its port (0: any free port).")
    tls: TlsConfig | None = Field(
        None, description="Serve the console over HTTPS; SIGHUP reloads the certificate."
    )
    admin_token_hashes: HashedKeys = Field(
        default_factory=list,
        description="SHA-256 hashes of the admin tokens that may log in, as sha256:<64 hex> "
        "(make one with `headwater hash-key`); none: `headwater up` serves no console.",
    )
    session_ttl_s: float = Field(
        12 * 3600.0, gt=0, description="How long a login lasts before the token is asked again."
    )
    sample_interval_s: float = Field(
        10.0, gt=0, description="How often the overview's charts take a point (an hour is kept)."
    )
    collector_url: str | None = Field(
        None,
        description="A collector whose /metrics the console reads for intake rates when it runs "
        "apart from it (default: the collector of this config, http(s)://collector.host:port; "
        "under `headwater up` the collector's own counters).",
    )
    page_size: int = Field(50, ge=1, le=1000, description="Rows per page of the long lists.")
