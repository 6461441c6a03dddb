"""A ``type: delta`` destination's ``options`` (docs/delta.md)."""

from __future__ import annotations

from pydantic import Field, field_validator

from headwater.config.base import Section

EVENT_TIME = "_timestamp"  # the context step's receive time
DEFAULT_PARTITION = f'CAST("{EVENT_TIME}" AS DATE)'  # the event's UTC day
AUTO = "auto"


class DeltaOptions(Section):
    partition_by: str | None = Field(
        AUTO,
        description="DuckDB SQL over a row's columns whose value partitions the tables "
        f"(auto: {DEFAULT_PARTITION} when appending, none with a primary key; null: none).",
    )
    partition_column: str = Field(
        "event_date", description="The partition value's column (a table column like any other)."
    )
    auto_compact_every: int = Field(
        0,
        ge=0,
        description="Compact a table's partitions written lately after every N commits to it "
        "(0: never; `headwater pipeline optimize` does it on demand).",
    )
    target_file_mb: int = Field(128, gt=0, description="Compaction's target file size, in MiB.")
    zorder_by: list[str] = Field(
        default_factory=list,
        description="Columns `headwater pipeline optimize` Z-orders by (none: compaction only).",
    )
    compression: str = Field("snappy", description="Parquet compression of the data files.")
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="Extra object-store settings for s3a:// paths (delta-rs names, e.g. "
        "AWS_S3_ALLOW_UNSAFE_RENAME); credentials come from the AWS_* environment.",
    )

    @field_validator("partition_column")
    @classmethod
    def _column(cls, v: str) -> str:
        from headwater.destinations.delta.dialect import DeltaDialect

        if DeltaDialect().normalize(v) != v:
            raise ValueError(f"{v!r} is not a column name as Delta tables keep them (a-z, 0-9, _)")
        return v

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str) -> str:
        allowed = ("snappy", "zstd", "gzip", "lz4", "none")
        if v not in allowed:
            raise ValueError(f"unknown compression {v!r}; one of {', '.join(allowed)}")
        return v

    def partition_expression(self, upsert: bool) -> str | None:
        """The partitioning expression in effect (None: the tables are not partitioned)."""
        if self.partition_by == AUTO:
            return None if upsert else DEFAULT_PARTITION
        return self.partition_by or None
