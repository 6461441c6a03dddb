"""The ``transport`` section of ``headwater.yaml``: the readers that bring other systems' data
onto the log (``transport.readers``, each with ``id`` and ``type``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from headwater.config.base import Identifier, Section, require_unique_ids

_IDENT = re.compile(r"^[a-z_][a-z0-9_$]{0,62}$")
DEFAULT_TOPIC_PATTERN = "cdc.{reader}.{namespace}"
TOPIC_FIELDS = ("reader", "namespace", "database", "schema", "table")


class ReaderBase(Section):
    id: Identifier = Field(description="Names the reader: its state, its status and its topics.")
    topic: str = Field(
        DEFAULT_TOPIC_PATTERN,
        description="Topic per namespace: text with {reader}, {namespace}, and for postgres "
        "{database}, {schema}, {table}; characters a topic name cannot hold become '_'.",
    )
    partitions: int | None = Field(
        None, gt=0, description="Partitions of each topic the reader makes (default: the bus's)."
    )
    batch_records: int = Field(
        5_000, gt=0, description="Most changes appended to the log in one durable batch."
    )
    linger_ms: float = Field(
        20.0, ge=0, description="How long a partly filled batch waits for more changes."
    )

    @field_validator("topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        try:
            v.format(**dict.fromkeys(TOPIC_FIELDS, "x"))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"topic pattern {v!r} is not valid: {e}; it may use {{{'}, {'.join(TOPIC_FIELDS)}}}"
            ) from None
        return v


class PostgresReaderConfig(ReaderBase):
    type: Literal["postgres"]
    dsn: str = Field(description="Connection string of the source database.")
    tables: list[str] | str = Field(
        description="Tables to capture: a list of names (schema.table, or table in public), "
        "or one regular expression over schema.table."
    )
    slot: str | None = Field(None, description="Replication slot (default: headwater_<id>).")
    publication: str | None = Field(
        None, description="Publication, made when missing (default: headwater_<id>)."
    )
    snapshot: Literal["initial", "never"] = Field(
        "initial", description="initial: copy the tables first, consistently with the slot."
    )
    heartbeat_s: float = Field(
        10.0, gt=0, description="How often a quiet reader makes the slot advance."
    )

    @field_validator("slot", "publication")
    @classmethod
    def _ident(cls, v: str | None) -> str | None:
        if v is not None and not _IDENT.match(v):
            raise ValueError("must be a lower-case SQL identifier (a-z, 0-9, _, $)")
        return v

    @field_validator("tables")
    @classmethod
    def _tables(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str):
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        elif not v:
            raise ValueError("names no table")
        return v

    def slot_name(self) -> str:
        return self.slot or f"headwater_{self.id.replace('-', '_')}"

    def publication_name(self) -> str:
        return self.publication or f"headwater_{self.id.replace('-', '_')}"


class FilesReaderConfig(ReaderBase):
    type: Literal["files"]
    path: Path = Field(description="The directory to read.")
    format: Literal["jsonl", "csv", "parquet"] = Field(description="The files' format.")
    glob: str = Field("*", description="Which files of the directory (a glob, recursive with **).")
    poll_s: float = Field(1.0, gt=0, description="How often the directory is looked at again.")


class KafkaReaderConfig(ReaderBase):
    type: Literal["kafka"]
    bootstrap_servers: str = Field(description="host:port[,host:port] of the external cluster.")
    topics: list[str] = Field(min_length=1, description="The external topics to read.")
    client: dict[str, Any] = Field(
        default_factory=dict, description="More client settings (librdkafka names: TLS, SASL)."
    )
    start: Literal["earliest", "latest"] = Field(
        "earliest",
        description="Where a partition the reader has no offset for yet starts: its first "
        "record, or the next one produced.",
    )


ReaderConfig = Annotated[
    PostgresReaderConfig | FilesReaderConfig | KafkaReaderConfig, Field(discriminator="type")
]


class TransportConfig(Section):
    readers: list[ReaderConfig] = Field(
        default_factory=list, description="Readers: postgres (CDC), files, kafka."
    )
    host: str = Field("127.0.0.1", description="`headwater transport`: /healthz address.")
    port: int = Field(8092, ge=0, le=65535, description="`headwater transport`: /healthz port.")

    @model_validator(mode="after")
    def _unique(self) -> TransportConfig:
        require_unique_ids(self.readers, "two readers have the id {!r}")
        return self

    def reader(self, reader_id: str) -> ReaderConfig:
        for r in self.readers:
            if r.id == reader_id:
                return r
        known = ", ".join(r.id for r in self.readers) or "none"
        raise KeyError(f"no reader {reader_id!r} in transport.readers (configured: {known})")
