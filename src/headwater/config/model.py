"""The root of ``headwater.yaml``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from headwater.bus.config import BusConfig
from headwater.collector.config import CollectorConfig
from headwater.config.base import Section
from headwater.console.config import ConsoleConfig
from headwater.pipeline.config import PipelineConfig
from headwater.transport.config import TransportConfig
from headwater.webhooks.config import WebhooksConfig


class HeadwaterConfig(Section):
    data_dir: Path = Field(
        Path("./data"), description="Root of local state: log, checkpoints, DuckDB warehouse."
    )
    bus: BusConfig = Field(default_factory=BusConfig, description="The log between services.")
    collector: CollectorConfig = Field(
        default_factory=CollectorConfig, description="The event intake (HTTP, WebSocket, gRPC)."
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="The Spark pipeline and its destinations."
    )
    webhooks: WebhooksConfig = Field(
        default_factory=WebhooksConfig, description="The webhook transport (senders, receivers)."
    )
    transport: TransportConfig = Field(
        default_factory=TransportConfig,
        description="Readers that bring other systems onto the log (PostgreSQL CDC, files, Kafka).",
    )
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig, description="The operator console (a web site)."
    )

    @classmethod
    def from_trusted_json(cls, text: str | bytes) -> HeadwaterConfig:
        """A config validated where it was loaded, passed on as JSON (to Spark's workers):
        validated again, but its Python functions are not imported here (the program says
        where the workers find them)."""
        from headwater.transport.functions import IMPORTS

        return cls.model_validate_json(text, context={IMPORTS: False})

    def log_dir(self) -> Path:
        """Where the embedded log lives."""
        return self.bus.embedded.path or self.data_dir / "log"

    def checkpoint_dir(self) -> Path:
        """Where the pipeline's queries keep their checkpoints."""
        return self.pipeline.checkpoint_dir or self.data_dir / "checkpoints"

    def webhooks_state_path(self) -> Path:
        """The embedded webhook state's file."""
        return self.webhooks.state.path or self.data_dir / "webhooks" / "state.sqlite"

    def transport_dir(self, reader_id: str) -> Path:
        """Where a transport reader keeps its state."""
        return self.data_dir / "transport" / reader_id

    def warehouse_path(self) -> Path:
        """The default DuckDB warehouse file."""
        return self.data_dir / "warehouse.duckdb"
