"""The ``pipeline`` section of ``headwater.yaml``: Spark, the failed store, lookups, and the
destinations, each of which runs as its own streaming query with its own checkpoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from headwater.config.base import Identifier, Section, require_unique_ids
from headwater.pipeline.contracts import ContractMap
from headwater.pipeline.enrichment_config import EnrichmentRule
from headwater.transport.functions import FunctionConfig, trusted

DESTINATION_TYPES = (
    "duckdb",
    "postgres",
    "clickhouse",
    "files",
    "delta",
    "http",
    "redshift",
    "snowflake",
    "bigquery",
)
MIRROR_TYPES = ("duckdb", "postgres", "clickhouse", "delta")  # destinations that can apply: upsert
DEFAULT_TOPIC_PATTERN = r"events-.*|clickstream-.*"
MIRROR_TOPIC_PATTERN = r"cdc\..*"  # the transport readers' default topics


class MappingField(Section):
    src: str | None = Field(None, description="JSON path of the field the rule reads: /a/b.")
    dst: str | None = Field(None, description="JSON path the rule writes (move, constant).")
    action: Literal["move", "remove", "cast", "constant"] = Field(
        description="move a subtree, remove it, give it an explicit SQL type, or set a constant."
    )
    type: str | None = Field(
        None, description="SQL type for cast (required) and move (optional), in the dialect."
    )
    value: Any = Field(None, description="The value written by constant.")

    @model_validator(mode="after")
    def _needs(self) -> MappingField:
        needs = {
            "move": ("src", "dst"),
            "remove": ("src",),
            "cast": ("src", "type"),
            "constant": ("dst",),
        }[self.action]
        missing = [k for k in needs if getattr(self, k) is None]
        if missing:
            raise ValueError(f"action {self.action!r} needs {' and '.join(missing)}")
        for key in ("src", "dst"):
            path = getattr(self, key)
            if path is not None and not path.strip("/"):
                raise ValueError(f"{key} {path!r} names no field")
        return self


class MappingConfig(Section):
    keep_unmapped: bool = Field(True, description="Keep fields no rule names (else drop them).")
    fields: list[MappingField] = Field(default_factory=list, description="Rules, in order.")


class DestinationConfig(Section):
    id: Identifier = Field(description="Names the destination: its query, checkpoint and ledger.")
    type: str = Field(description=f"One of: {', '.join(DESTINATION_TYPES)}.")
    mode: Literal["stream", "batch"] = Field(
        "batch", description="stream: continuously; batch: all available every batch_period_s."
    )
    batch_period_s: float = Field(300.0, gt=0, description="How often a batch-mode run starts.")
    trigger_interval_s: float = Field(
        1.0, ge=0, description="Stream mode: the processing-time trigger's interval."
    )
    max_records_per_trigger: int = Field(
        1_000_000, gt=0, description="Most records one micro-batch reads."
    )
    topics: list[str] | None = Field(None, description="Topics to read, by name.")
    topic_pattern: str = Field(
        DEFAULT_TOPIC_PATTERN,
        description="Regex over topic names to read, used when topics is not given (apply: "
        "upsert reads the transport's topics, cdc\\..*, by default).",
    )
    table_name_template: str = Field(
        "events",
        description="Table per event: text with {{ field.path }} substitutions; empty = skip.",
    )
    primary_key: list[str] = Field(
        default_factory=list, description="Columns to upsert on (default: append)."
    )
    mapping: MappingConfig = Field(default_factory=MappingConfig, description="Mapping rules.")
    enrichment: list[EnrichmentRule] = Field(
        default_factory=list,
        description="Enrichments by name, run in a fixed order (docs/shaping.md): ip_lookup, "
        "user_agent_parse, and the others there.",
    )
    contracts: ContractMap = Field(
        default_factory=dict,
        description='Event type -> JSON Schema file and mode; "*" for types with no contract '
        "(docs/shaping.md).",
    )
    path: Path | None = Field(
        None,
        description="duckdb: database file; clickhouse (chdb): data folder; files: folder; "
        "delta: folder or s3a://bucket/prefix of the tables.",
    )
    dsn: str | None = Field(
        None, description="postgres: connection string; clickhouse: server URL (http://...)."
    )
    format: Literal["parquet", "jsonl.gz"] = Field("parquet", description="files: the format.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings particular to the destination type (http: url, format, group_by, "
        "...; see docs/delivery.md).",
    )
    apply: Literal["append", "upsert"] = Field(
        "append",
        description="append: events become rows; upsert: transport changes are applied so "
        "that each table mirrors its source (duckdb, postgres, clickhouse, delta; "
        "docs/transport.md).",
    )
    namespace: str = Field(
        ".*", description="apply: upsert: a regex over the namespaces (db.schema.table) taken."
    )
    functions: list[FunctionConfig] = Field(
        default_factory=list,
        description="Functions run on each event (append: pick, omit, rename, filter, sql, "
        "python; docs/shaping.md) or message (apply: upsert: pick, omit, rename, skip, filter, "
        "python; docs/transport.md), in order.",
    )
    mirror_table: str = Field(
        "{table}",
        description="apply: upsert: the table of a namespace, with {database}, {schema}, {table}.",
    )
    on_error: Literal["isolate", "stop"] = Field(
        "isolate",
        description="apply: upsert, when a batch fails: isolate applies it change by change and "
        "fails only the bad ones; stop stops the destination at its last committed batch.",
    )

    @model_validator(mode="before")
    @classmethod
    def _mirror_topics(cls, data: Any) -> Any:
        """A mirror reads the transport's topics unless told otherwise."""
        if isinstance(data, dict) and data.get("apply") == "upsert" and "topic_pattern" not in data:
            return {**data, "topic_pattern": MIRROR_TOPIC_PATTERN}
        return data

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in DESTINATION_TYPES:
            raise ValueError(
                f"unknown destination type {v!r}; one of {', '.join(DESTINATION_TYPES)}"
            )
        return v

    @field_validator("topic_pattern", "namespace")
    @classmethod
    def _pattern(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _connection(self, info: ValidationInfo) -> DestinationConfig:
        if self.type == "postgres" and not self.dsn:
            raise ValueError("a postgres destination needs dsn")
        if self.type in ("redshift", "snowflake", "bigquery") and not self.dsn:
            raise ValueError(f"a {self.type} destination needs dsn")
        if self.apply == "upsert" and self.type not in MIRROR_TYPES:
            raise ValueError(
                f"apply: upsert needs a {' or '.join(MIRROR_TYPES)} destination, not {self.type}"
            )
        # SQL expressions are parsed by DuckDB, which Spark's planning processes need not load
        self._check_functions(expressions=not trusted(info))
        if self.type == "delta":
            from headwater.destinations.delta.config import DeltaOptions

            try:
                DeltaOptions.model_validate(self.options)
            except ValueError as e:
                raise ValueError(f"a delta destination's options: {e}") from None
        if self.type == "http":
            from headwater.delivery.config import HttpDeliveryConfig

            try:
                HttpDeliveryConfig.model_validate(self.options)
            except ValueError as e:
                raise ValueError(f"an http destination's options: {e}") from None
        return self

    def _check_functions(self, expressions: bool = True) -> None:
        names = [f.name for f in self.functions]
        if self.apply == "upsert":
            if "sql" in names:
                raise ValueError("functions: sql runs on events, not on an apply: upsert mirror")
            return
        if "skip" in names:
            raise ValueError(
                "functions: skip compares transport message fields; on events use filter "
                "(a DuckDB SQL condition over the event's fields)"
            )
        from headwater.pipeline.steps.functions import FunctionExpressionError, check

        for f in self.functions:
            if f.name in ("sql", "filter") and expressions:
                try:
                    check(f.expression, f.label)
                except FunctionExpressionError as e:
                    raise ValueError(f"functions: {e.message}") from None
        python = [i for i, n in enumerate(names) if n == "python"]
        if python and python[-1] != len(python) - 1:
            raise ValueError(
                "functions: python functions run first, on each event as it came (before the "
                "enrichments and the other functions): list them before the others"
            )


class SparkConfig(Section):
    master: str = Field("local[2]", description="Spark master URL (local[2]: this machine).")
    conf: dict[str, str] = Field(default_factory=dict, description="Extra Spark settings.")


class ProtobufType(Section):
    descriptor_set: Path = Field(description="A FileDescriptorSet file (protoc -o).")
    message: str = Field(description="Full name of the message type: pkg.Message.")


def _default_destinations() -> list[DestinationConfig]:
    # Streams, so a newcomer's first event is a row within seconds (batch stays configurable).
    return [DestinationConfig(id="warehouse", type="duckdb", mode="stream")]


class PipelineConfig(Section):
    spark: SparkConfig = Field(default_factory=SparkConfig, description="Where Spark runs.")
    checkpoint_dir: Path | None = Field(
        None, description="Checkpoints of the queries (default: data_dir/checkpoints)."
    )
    failed_topic: str = Field("headwater-failed", description="The failed store's topic.")
    geoip_database: Path | None = Field(
        None, description="A MaxMind-format (.mmdb) database for ip_lookup."
    )
    protobuf: dict[str, ProtobufType] = Field(
        default_factory=dict, description="Protobuf payloads: event type -> message type."
    )
    destinations: list[DestinationConfig] = Field(
        default_factory=_default_destinations, description="Where events go."
    )

    @model_validator(mode="after")
    def _unique(self) -> PipelineConfig:
        require_unique_ids(self.destinations, "destination id {!r} is used twice")
        return self
