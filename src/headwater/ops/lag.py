"""Each group's (writer's) committed offsets, the high watermarks and the lag between them:
what ``headwater log offsets`` prints and the console shows."""

from __future__ import annotations

from typing import Any

from headwater.bus import Bus
from headwater.bus.errors import UnknownTopic
from headwater.bus.records import TopicPartition


def group_rows(bus: Bus, group: str) -> list[dict[str, Any]]:
    """Per partition of every topic ``group`` committed on: committed, low, high and lag (a
    partition without a commit counts from the low watermark)."""
    committed = bus.committed(group)
    topics = sorted({tp.topic for tp in committed})
    rows: list[dict[str, Any]] = []
    for topic in topics:
        try:
            partitions = range(bus.topic(topic).partitions)
        except UnknownTopic:
            partitions = range(0)
            for tp, offset in sorted(committed.items()):
                if tp.topic == topic:
                    rows.append(lag_row(topic, tp.partition, offset, None, None))
        for p in partitions:
            low, high = bus.watermarks(topic, p)
            rows.append(lag_row(topic, p, committed.get(TopicPartition(topic, p)), low, high))
    return rows


def lag_row(
    topic: str, partition: int, committed: int | None, low: int | None, high: int | None
) -> dict[str, Any]:
    """One partition's row: ``committed`` is the next offset the writer reads (None: it has
    not committed; its lag counts from ``low``)."""
    lag: int | None = None
    if high is not None and low is not None:
        lag = max(0, high - max(committed if committed is not None else low, low))
    return {
        "topic": topic,
        "partition": partition,
        "committed": committed,
        "low": low,
        "high": high,
        "lag": lag,
    }
