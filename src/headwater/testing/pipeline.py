"""Test helpers for the pipeline: micro-batches in the source's layout, without a log."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from headwater.bus import context

SOURCE_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "timestampType int, headers array<struct<key:string,value:binary>>"
)
EPOCH_2024 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def event_row(
    value: Mapping[str, Any] | bytes | str,
    *,
    offset: int = 0,
    topic: str = "events-track",
    headers: Mapping[str, str] | None = None,
    key: bytes | None = None,
    content_type: str | None = "application/json",
) -> tuple[Any, ...]:
    """One row as the source gives it; a mapping is sent as JSON."""
    if isinstance(value, Mapping):
        data = json.dumps(value).encode()
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = value
    base = {
        context.TYPE: topic.split("-", 1)[-1],
        context.EVENT_ID: f"ev-{offset}",
        context.RECEIVED_AT: "2024-05-01T12:00:00.000Z",
        context.CLIENT_IP: "81.2.69.142",
        context.SOURCE: "web",
        context.PROTOCOL: "segment",
    }
    if content_type is not None:
        base[context.CONTENT_TYPE] = content_type
    base.update(headers or {})
    hdrs = [(k, v.encode()) for k, v in base.items()]
    return (key, data, topic, 0, offset, EPOCH_2024, 0, hdrs)


def batch(spark: Any, values: Sequence[Mapping[str, Any] | bytes | str], **kw: Any) -> Any:
    """A DataFrame of ``values`` at offsets 0, 1, ... in the source's layout."""
    rows = [event_row(v, offset=i, **kw) for i, v in enumerate(values)]
    return spark.createDataFrame(rows, SOURCE_SCHEMA)
