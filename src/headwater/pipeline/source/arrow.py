"""The Kafka source's column layout, which now lives with the bus (``headwater.bus.arrow``):
re-exported here for the Spark source's modules."""

from __future__ import annotations

from headwater.bus.arrow import (
    ARROW_SCHEMA,
    CREATE_TIME,
    HEADER_TYPE,
    SCHEMA_DDL,
    to_record_batch,
)

__all__ = ["ARROW_SCHEMA", "CREATE_TIME", "HEADER_TYPE", "SCHEMA_DDL", "to_record_batch"]
