"""Bus records as Arrow record batches in the column layout of Spark's Kafka source:
``key, value, topic, partition, offset, timestamp, timestampType, headers``.

The layout is a bus-level contract: ``Bus.read_arrow`` returns it on every backend, and the
pipeline's Spark source declares it (``SCHEMA_DDL``), so Spark's own Kafka connector can take the
source's place. ``to_record_batch`` builds it from records (the Kafka backend's way, and the
reference the embedded log's columnar decode is tested against).
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from headwater.bus.layout import CREATE_TIME, SCHEMA_DDL
from headwater.bus.records import Record

__all__ = ["ARROW_SCHEMA", "CREATE_TIME", "HEADER_TYPE", "SCHEMA_DDL", "to_record_batch"]

HEADER_TYPE = pa.struct([("key", pa.string()), ("value", pa.binary())])
HEADERS_TYPE = pa.list_(HEADER_TYPE)
TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", TIMESTAMP_TYPE),
        ("timestampType", pa.int32()),
        ("headers", HEADERS_TYPE),
    ]
)


def to_record_batch(records: Sequence[Record]) -> pa.RecordBatch:
    """One Arrow batch of ``records`` (all from one topic-partition)."""
    n = len(records)
    header_keys: list[str] = []
    header_values: list[bytes] = []
    bounds = [0]
    for r in records:
        for name, value in r.headers:
            header_keys.append(name)
            header_values.append(value)
        bounds.append(len(header_keys))
    headers = pa.ListArray.from_arrays(
        pa.array(bounds, pa.int32()),
        pa.StructArray.from_arrays(
            [pa.array(header_keys, pa.string()), pa.array(header_values, pa.binary())],
            fields=list(HEADER_TYPE),
        ),
    )
    millis = pa.array([r.timestamp for r in records], pa.int64())
    first = records[0] if n else None
    columns = [
        pa.array([r.key for r in records], pa.binary()),
        pa.array([r.value for r in records], pa.binary()),
        pa.array([first.topic if first else ""] * n, pa.string()),
        pa.array([first.partition if first else 0] * n, pa.int32()),
        pa.array([r.offset for r in records], pa.int64()),
        pc.multiply(millis, 1000).cast(TIMESTAMP_TYPE),
        pa.array([CREATE_TIME] * n, pa.int32()),
        headers,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
