"""Running the destinations' queries: one Spark streaming query per destination, each with its
own checkpoint (``<checkpoint_dir>/<destination id>``), so each has its own offsets over the log.

- ``mode: stream``: the query runs continuously with a processing-time trigger.
- ``mode: batch``: the same query with ``Trigger.AvailableNow`` (everything on the log when it
  starts, in micro-batches of at most ``max_records_per_trigger``), started again every
  ``batch_period_s``.

Each query reads the destination's topics from the bus and, from the failed store, its replay
topic, so replayed events take the same path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.failed import failed_config, replay_topic
from headwater.pipeline.writer import DestinationWriter

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

log = logging.getLogger(__name__)


def source_frame(
    spark: SparkSession, config: HeadwaterConfig, dest: DestinationConfig
) -> DataFrame:
    """The destination's input: its topics on the bus, and its replay topic."""
    from headwater.pipeline.source import read_stream

    main = read_stream(
        spark,
        config,
        topics=dest.topics,
        pattern=None if dest.topics else dest.topic_pattern,
        max_records_per_trigger=dest.max_records_per_trigger,
    )
    replay = read_stream(
        spark,
        failed_config(config),
        topics=[replay_topic(dest.id)],
        max_records_per_trigger=dest.max_records_per_trigger,
    )
    return main.unionByName(replay)


@dataclass
class DestinationQuery:
    dest: DestinationConfig
    writer: DestinationWriter
    query: StreamingQuery | None = None
    runs: int = 0
    error: BaseException | None = None
    thread: threading.Thread | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class Pipeline:
    """The configured destinations' queries on one SparkSession."""

    def __init__(
        self,
        config: HeadwaterConfig,
        spark: SparkSession,
        destinations: list[str] | None = None,
        echo: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.config = config
        self.spark = spark
        self.echo = echo
        chosen = config.pipeline.destinations
        if destinations:
            known = {d.id for d in chosen}
            unknown = [d for d in destinations if d not in known]
            if unknown:
                raise ConfigError(
                    f"no destination named {', '.join(unknown)} in pipeline.destinations "
                    f"(configured: {', '.join(sorted(known)) or 'none'})"
                )
            chosen = [d for d in chosen if d.id in destinations]
        self.queries = [DestinationQuery(d, DestinationWriter(config, d)) for d in chosen]
        self._stop = threading.Event()

    def checkpoint(self, dest: DestinationConfig) -> str:
        return str(self.config.checkpoint_dir() / dest.id)

    def _start(self, q: DestinationQuery, *, available_now: bool) -> StreamingQuery:
        frame = source_frame(self.spark, self.config, q.dest)
        writer = (
            frame.writeStream.foreachBatch(q.writer)
            .option("checkpointLocation", self.checkpoint(q.dest))
            .queryName(f"headwater-{q.dest.id}")
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{q.dest.trigger_interval_s} seconds")
        query = writer.start()
        q.query = query
        q.runs += 1
        return query

    def run_once(self) -> None:
        """Every destination's query once with AvailableNow, until each has caught up."""
        for q in self.queries:
            self._start(q, available_now=True).awaitTermination()

    def start(self) -> None:
        """Start every destination in its mode; returns at once."""
        for q in self.queries:
            if q.dest.mode == "stream":
                self._start(q, available_now=False)
                self.echo(f"headwater: destination {q.dest.id}: streaming ({q.dest.type})")
            else:
                q.thread = threading.Thread(
                    target=self._batch_loop, args=(q,), name=f"batch-{q.dest.id}", daemon=True
                )
                q.thread.start()
                self.echo(
                    f"headwater: destination {q.dest.id}: batch every {q.dest.batch_period_s:g} s"
                    f" ({q.dest.type})"
                )

    def _batch_loop(self, q: DestinationQuery) -> None:
        try:
            while not self._stop.is_set():
                query = self._start(q, available_now=True)
                query.awaitTermination()
                if self._stop.wait(q.dest.batch_period_s):
                    break
        except BaseException as exc:  # reported by wait()/failed()
            if not self._stop.is_set():
                q.error = exc
                log.exception("destination %s: batch run failed", q.dest.id)
        finally:
            q.finished.set()

    def failed(self) -> list[tuple[str, BaseException]]:
        """Destinations whose query stopped with an error."""
        out = []
        for q in self.queries:
            if q.error is not None:
                out.append((q.dest.id, q.error))
            elif q.query is not None and q.dest.mode == "stream" and q.query.exception():
                out.append((q.dest.id, RuntimeError(str(q.query.exception()))))
        return out

    def stop(self) -> None:
        """Stop the queries: a running micro-batch finishes first (its write and its offsets
        commit together, so stopping at any point loses and duplicates nothing)."""
        self._stop.set()
        for q in self.queries:
            if q.query is not None and q.query.isActive:
                q.query.stop()
            if q.thread is not None:
                q.thread.join(timeout=60)
            q.writer.close()
