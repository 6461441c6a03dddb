"""Config of the embedded commit log (``bus.embedded``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from headwater.config.base import Section

GiB = 1 << 30
MiB = 1 << 20


class RetentionConfig(Section):
    bytes: int | None = Field(
        None, ge=0, description="Delete closed segments once a partition holds more than this."
    )
    ms: int | None = Field(
        None, ge=0, description="Delete closed segments whose newest record is older than this."
    )
    respect_writers: bool = Field(
        True,
        description="Never delete records a registered writer (group) has not committed past.",
    )
    check_interval_ms: int = Field(
        60_000, gt=0, description="How often the limits are enforced while the log is open."
    )


class EmbeddedBusConfig(Section):
    path: Path | None = Field(None, description="Directory of the log; default: <data_dir>/log.")
    durability: Literal["always", "interval", "never"] = Field(
        "always",
        description="always: an append resolves once fdatasync'd (group commit); "
        "interval: fdatasync every flush_interval_ms; never: leave it to the OS.",
    )
    flush_interval_ms: int = Field(
        200, gt=0, description="How often `interval` durability calls fdatasync."
    )
    segment_bytes: int = Field(
        GiB, ge=1024, description="Roll to a new segment file once the active one reaches this."
    )
    index_interval_bytes: int = Field(
        4096, gt=0, description="Add a sparse index entry every this many bytes of a segment."
    )
    page_cache_bytes: int = Field(
        256 * MiB,
        ge=0,
        description="How much of each partition's most recent, fdatasync'd data stays in the "
        "page cache; older synced data is dropped from it (posix_fadvise DONTNEED), so the log "
        "writes into memory it has just freed instead of filling the machine's page cache. "
        "On VMs that hand freed memory back to the host (virtio-balloon free page reporting) "
        "writing into never-touched memory is several times slower. 0 keeps everything "
        "(leaves it to the OS).",
    )
    max_record_bytes: int = Field(
        MiB, gt=0, description="Largest record (key + value + headers) accepted."
    )
    max_pending_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="Bytes queued for the log's writer beyond which appends are refused "
        "(backpressure: the collector answers 503; the command line, readers and workers wait).",
    )
    default_partitions: int = Field(2, ge=1, le=10_000, description="Partitions of new topics.")
    auto_create_topics: bool = Field(
        True, description="Create a topic on its first append instead of rejecting it."
    )
    offsets_flush_interval_ms: int = Field(
        1000, gt=0, description="How often committed group offsets are persisted."
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig, description="What the log may delete."
    )
