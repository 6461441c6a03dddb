"""The ``headwater`` Spark data source: batch and streaming reads of the log, for both bus
backends, on PySpark's Python Data Source API.

Planning (offsets, ranges) runs in Spark's planner-side Python process, reading runs in the
Python workers; each process opens the bus read-only once per config and keeps it (the
embedded log has one writer, the collector; readers never take its lock).

``commit(end)`` does nothing: Spark calls it a batch late, and a destination's checkpoint (with
its ledger) is what says how far it got (seed 003: each writer owns its offsets).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

import headwater.pipeline.source.offsets as off
from headwater.bus import Bus, open_bus
from headwater.bus.errors import OffsetOutOfRange
from headwater.bus.layout import SCHEMA_DDL
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.source.options import RANGES, Feed, SourceOptions, parse_options

log = logging.getLogger(__name__)

SOURCE_NAME = "headwater"
RANGES_SCHEMA_DDL = "bus string, topic string, partition int, start long, end long"
CHUNK = 8_192  # records per bus read (the bus sizes the Arrow batches it returns)

_buses: dict[str, Bus] = {}
_buses_lock = threading.Lock()


def bus_for(config_json: str) -> Bus:
    """This process's read-only bus for a config (opened on first use)."""
    with _buses_lock:
        bus = _buses.get(config_json)
        if bus is None:
            bus = open_bus(HeadwaterConfig.from_trusted_json(config_json), read_only=True)
            _buses[config_json] = bus
        return bus


def watermarks(opts: SourceOptions) -> dict[tuple[str, int], tuple[int, int]]:
    """(low, high) of every partition of the selected topics, as they are now."""
    marks = {}
    for feed, topic in chosen_topics(opts):
        bus = bus_for(feed.config_json)
        for partition in range(bus.topic(topic).partitions):
            marks[(topic, partition)] = bus.watermarks(topic, partition)
    return marks


def chosen_topics(opts: SourceOptions) -> list[tuple[Feed, str]]:
    """The topics the source reads, with the feed (bus) each is on; a topic two feeds name is
    read from the first."""
    out: list[tuple[Feed, str]] = []
    seen: set[str] = set()
    for feed in opts.feeds:
        bus = bus_for(feed.config_json)
        existing = (t.name for t in bus.topics())
        for topic in off.select_topics(existing, feed.topics, feed.pattern, feed.internal_topics):
            if topic not in seen:
                seen.add(topic)
                out.append((feed, topic))
    return out


class LogRange(InputPartition):
    """One Spark task: records ``[start, end)`` of one topic-partition (on the bus of
    ``feed``, or of ``config_json``)."""

    def __init__(self, feed: Feed | str, r: off.Range) -> None:
        super().__init__(r)
        self.config_json = feed if isinstance(feed, str) else feed.config_json
        self.bus_name = "" if isinstance(feed, str) else feed.bus_name
        self.range = r


class LogRanges(InputPartition):
    """The ``ranges`` layout's one task: every range of the batch, as rows."""

    def __init__(self, ranges: list[LogRange]) -> None:
        super().__init__(len(ranges))
        self.ranges = ranges


def planned(opts: SourceOptions, ranges: Sequence[off.Range]) -> list[InputPartition]:
    """Spark's tasks for ``ranges``: one per range, or in the ``ranges`` layout one for all
    (reading a row per range is no work to spread)."""
    feeds = {topic: feed for feed, topic in chosen_topics(opts)}
    parts = [LogRange(feeds.get(r.topic, opts.feeds[0]), r) for r in ranges]
    if opts.layout == RANGES:
        return [LogRanges(parts)] if parts else []
    return list(parts)


def ranges_batch(opts: SourceOptions, parts: Sequence[LogRange]) -> Any:
    """The ``ranges`` layout: one row per range (``RANGES_SCHEMA_DDL``)."""
    import pyarrow as pa

    return pa.RecordBatch.from_pylist(
        [
            {
                "bus": p.bus_name,
                "topic": p.range.topic,
                "partition": p.range.partition,
                "start": p.range.start,
                "end": p.range.end,
            }
            for p in parts
        ],
        schema=pa.schema(
            [
                ("bus", pa.string()),
                ("topic", pa.string()),
                ("partition", pa.int32()),
                ("start", pa.int64()),
                ("end", pa.int64()),
            ]
        ),
    )


def read(opts: SourceOptions, part: InputPartition) -> Iterator[Any]:
    """A task's rows in the source's layout: the records, or the ranges themselves."""
    if isinstance(part, LogRanges):
        yield ranges_batch(opts, part.ranges)
        return
    assert isinstance(part, LogRange)
    yield from read_range(part)


def read_range(part: LogRange) -> Iterator[Any]:
    """The records of a range as Arrow batches (gaps left by compaction are skipped; a start
    below the low watermark, where retention deleted records, reads from the low watermark)."""
    bus = bus_for(part.config_json)
    topic, partition, offset, end = part.range
    while offset < end:
        try:
            batches = bus.read_arrow(topic, partition, offset, end, max_records=CHUNK)
        except OffsetOutOfRange:
            low, _ = bus.watermarks(topic, partition)
            if offset >= low:
                raise
            log.warning(
                "%s/%d: offsets %d to %d were deleted by retention before they were read",
                topic,
                partition,
                offset,
                low - 1,
            )
            offset = low
            continue
        if not batches:
            return
        yield from batches
        offset = batches[-1]["offset"][-1].as_py() + 1


class HeadwaterStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.target: dict[tuple[str, int], int] | None = None

    def initialOffset(self) -> dict:
        return off.to_offsets(off.resolve(watermarks(self.opts), self.opts.starting))

    def getDefaultReadLimit(self) -> ReadLimit:
        cap = self.opts.max_records_per_trigger
        return ReadAllAvailable() if cap is None else ReadMaxRows(cap)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {tp: high for tp, (_, high) in watermarks(self.opts).items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = off.plan_end(off.from_offsets(start), watermarks(self.opts), cap, self.target)
        return off.to_offsets(end)

    def reportLatestOffset(self) -> dict | None:
        return off.to_offsets({tp: high for tp, (_, high) in watermarks(self.opts).items()})

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        ranges = off.ranges(
            off.from_offsets(start), off.from_offsets(end), self.opts.records_per_task
        )
        return planned(self.opts, ranges)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Nothing: the checkpoint is the source of truth."""


class HeadwaterBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        marks = watermarks(self.opts)
        start = off.resolve(marks, self.opts.starting)
        end = off.resolve(marks, self.opts.ending, unnamed="latest")
        return planned(self.opts, off.ranges(start, end, self.opts.records_per_task))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read(self.opts, partition)


class HeadwaterSource(DataSource):
    """``format("headwater")``: the log in the layout of Spark's Kafka source."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.opts = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return RANGES_SCHEMA_DDL if self.opts.layout == RANGES else SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return HeadwaterBatchReader(self.opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return HeadwaterStreamReader(self.opts)
