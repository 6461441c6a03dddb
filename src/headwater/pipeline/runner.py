"""Running the destinations' queries: one Spark streaming query per destination, each with its
own checkpoint (``<checkpoint_dir>/<destination id>``), so each has its own offsets over the log.

- ``mode: stream``: the query runs continuously with a processing-time trigger.
- ``mode: batch``: the same query with ``Trigger.AvailableNow`` (everything on the log when it
  starts, in micro-batches of at most ``max_records_per_trigger``), started again every
  ``batch_period_s``.

Each query reads the destination's topics from the bus and, from the failed store, its replay
topic, so replayed events take the same path.

A destination paused with ``status.pause`` (``headwater pipeline pause``, from any process) has
its query stopped between batches and started again from its checkpoint once it is resumed:
each supervisor polls ``<data_dir>/status/paused.json`` every ``POLL_S`` (a ``stat``) while it
waits for its query, its next batch-mode run, its next retry or its resumption.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from headwater.config.model import HeadwaterConfig
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.failed import FailedStore, failed_config, replay_topic
from headwater.pipeline.status import (
    BACKOFF,
    Backoff,
    LastBatch,
    PauseWatch,
    StatusBoard,
    classify,
    known_destinations,
)
from headwater.pipeline.writer import BatchStats, DestinationWriter

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from headwater.transport.mirror import MirrorWriter

    BatchWriter = DestinationWriter | MirrorWriter

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a supervisor looks at the pauses (and flushes the status board)


def source_frame(
    spark: SparkSession, config: HeadwaterConfig, dest: DestinationConfig, checkpoint: Path
) -> DataFrame:
    """The destination's input: its topics on the bus, and its replay topic. From headwater's
    source these are ranges of records (``sink.MAIN_BUS``, ``sink.FAILED_BUS``), which the sink's
    tasks read themselves, and one source reads both buses; from Spark's Kafka connector, the
    records, a source each (so do the queries of checkpoints made before one source read both:
    a query keeps the sources its checkpoint has)."""
    from headwater.pipeline.sink import FAILED_BUS, MAIN_BUS
    from headwater.pipeline.source import read_stream, uses_kafka_connector

    topics = dest.topics
    pattern = None if topics else dest.topic_pattern
    limit = dest.max_records_per_trigger
    replay = (failed_config(config), [replay_topic(dest.id)], FAILED_BUS)
    if uses_kafka_connector(spark, config):  # the failed store is on the same Kafka cluster
        log.info("destination %s reads Kafka through Spark's Kafka connector", dest.id)
        FailedStore(config).ensure_topic(replay[1][0])
        main = read_stream(spark, config, topics, pattern, limit)
        return main.unionByName(read_stream(spark, replay[0], replay[1], None, limit))
    if config.bus.backend == "kafka":
        log.warning(
            "destination %s reads Kafka through headwater's own source: Spark's Kafka connector "
            "is not on this session's classpath",
            dest.id,
        )
    if sources_in(checkpoint) in (None, 1):
        return read_stream(spark, config, topics, pattern, limit, ranges_of=MAIN_BUS, also=[replay])
    main = read_stream(spark, config, topics, pattern, limit, ranges_of=MAIN_BUS)
    replayed = read_stream(spark, replay[0], replay[1], None, limit, ranges_of=FAILED_BUS)
    return main.unionByName(replayed)


def writer_for(config: HeadwaterConfig, dest: DestinationConfig) -> BatchWriter:
    """The ``foreachBatch`` function of a destination: events to rows, or (``apply:
    upsert``) transport changes applied to mirror tables."""
    if dest.apply == "upsert":
        from headwater.transport.mirror import MirrorWriter

        return MirrorWriter(config, dest)
    return DestinationWriter(config, dest)


def sources_in(checkpoint: Path) -> int | None:
    """How many sources a streaming query's checkpoint has offsets for (None: no batch yet).
    Spark's offset log (``offsets/<batch>``) holds a version line, a metadata line and a line
    per source."""
    folder = checkpoint / "offsets"
    batches = [p for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    if not batches:
        return None
    latest = max(batches, key=lambda p: int(p.name))
    lines = [line for line in latest.read_text().splitlines() if line.strip()]
    return max(len(lines) - 2, 0)


def clear_unplanned_start(checkpoint: Path) -> list[Path]:
    """Remove what a kill left in a checkpoint whose first batch was never planned, and return it.

    Spark writes each offsets file to a hidden temporary beside it (``.0.<uuid>.tmp``, with its
    ``.crc``) and renames it. A kill before the first rename leaves the temporary alone in
    ``offsets``, and Spark then refuses the checkpoint for good (``offsets should be empty on
    batch 0``). With no batch in the offset log nothing was read or written from it, so the
    query may start as new. A checkpoint with a batch is left to Spark as it is."""
    folder = checkpoint / "offsets"
    if not folder.is_dir():
        return []
    files = list(folder.iterdir())
    if any(p.name.isdigit() for p in files):
        return []
    left = [p for p in files if p.name.startswith(".") and p.is_file()]
    for p in left:
        p.unlink()
    return left


def last_batch(writer: BatchWriter, batch_id: int, seconds: float) -> LastBatch:
    """The batch ``writer`` has just finished, as its stats say (rows per table; a mirror's
    writer counts changes, for all its tables together)."""
    stats, now = writer.last, time.time()
    if stats is None or stats.batch_id != batch_id:
        return LastBatch(batch_id=batch_id, committed_at=now, duration_s=seconds)
    if isinstance(stats, BatchStats):
        return LastBatch(
            batch_id=batch_id,
            committed_at=now,
            duration_s=seconds,
            rows=dict(stats.tables),
            written=stats.written,
            failed=stats.failed,
        )
    return LastBatch(
        batch_id=batch_id,
        committed_at=now,
        duration_s=seconds,
        written=stats.changes - stats.failed,
        failed=stats.failed,
    )


@dataclass
class DestinationQuery:
    dest: DestinationConfig
    writer: BatchWriter
    query: StreamingQuery | None = None
    runs: int = 0
    error: BaseException | None = None
    thread: threading.Thread | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    stale: bool = False  # the last run failed: the next one gets a fresh writer
    idle: threading.Event = field(default_factory=threading.Event)  # no write in progress

    def __post_init__(self) -> None:
        self.idle.set()


class Pipeline:
    """The configured destinations' queries on one SparkSession.

    Each destination has its own supervisor thread: when its query stops with an error (the
    writer raised, a destination is locked or down), the thread records it on the status board,
    waits (``status.BACKOFF``: exponential, capped, with jitter) and starts the query again from
    its checkpoint, for as long as it takes. A transient failure is expected and logged as a
    warning; anything else is logged loudly but retried too, since leaving the destination dead
    helps nobody (a terminal error in one batch's events is handled inside the writer, which
    sends them to the failed store). One destination's trouble never touches another's thread.

    The supervisor also follows the pauses (``status.PauseWatch``): a paused destination's query
    is stopped once no write is in progress, its writer closed (a DuckDB file is free meanwhile)
    and its state is ``paused`` until it is resumed; a destination paused before the pipeline
    starts is not started.
    """

    def __init__(
        self,
        config: HeadwaterConfig,
        spark: SparkSession,
        destinations: list[str] | None = None,
        echo: Callable[[str], None] = lambda _: None,
        backoff: Backoff = BACKOFF,
    ) -> None:
        self.config = config
        self.spark = spark
        self.echo = echo
        self.backoff = backoff
        chosen = config.pipeline.destinations
        if destinations:
            known_destinations(config, destinations)
            chosen = [d for d in chosen if d.id in destinations]
        self.queries = [DestinationQuery(d, writer_for(config, d)) for d in chosen]
        self.status = StatusBoard(config, [(d.id, d.mode) for d in chosen])
        self.pauses = PauseWatch(config)
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def checkpoint(self, dest: DestinationConfig) -> str:
        return str(self.config.checkpoint_dir() / dest.id)

    def _start(self, q: DestinationQuery, *, available_now: bool) -> StreamingQuery | None:
        """Start the destination's query (None: the pipeline is stopping)."""
        checkpoint = Path(self.checkpoint(q.dest))
        for left in clear_unplanned_start(checkpoint):
            log.warning(
                "destination %s: removed %s, a first batch's offsets never written (a kill)",
                q.dest.id,
                left,
            )
        frame = source_frame(self.spark, self.config, q.dest, checkpoint)
        dest_id, board, writer_fn = q.dest.id, self.status, q.writer

        def write(batch: DataFrame, batch_id: int) -> None:
            q.idle.clear()
            try:
                started = time.monotonic()
                writer_fn(batch, batch_id)
                done = last_batch(writer_fn, batch_id, time.monotonic() - started)
                board.succeeded(dest_id, done)
            finally:
                q.idle.set()

        writer = (
            frame.writeStream.foreachBatch(write)
            .option("checkpointLocation", self.checkpoint(q.dest))
            .queryName(f"headwater-{q.dest.id}")
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{q.dest.trigger_interval_s} seconds")
        with self._lock:  # stop() stops whatever query is current under the same lock
            if self._stop.is_set():
                return None
            query = writer.start()
            q.query = query
            q.runs += 1
        self.status.started(q.dest.id)
        return query

    def run_once(self) -> None:
        """Every destination's query once with AvailableNow, until each has caught up (a
        paused destination is left as it is)."""
        for q in self.queries:
            if self.pauses.is_paused(q.dest.id):
                self.echo(f"headwater: destination {q.dest.id}: paused, not caught up")
                self.status.paused(q.dest.id)
                continue
            query = self._start(q, available_now=True)
            if query is not None:
                query.awaitTermination()

    def start(self) -> None:
        """Start every destination in its mode, each under its supervisor; returns at once."""
        for q in self.queries:
            q.thread = threading.Thread(
                target=self._supervise, args=(q,), name=f"writer-{q.dest.id}", daemon=True
            )
            q.thread.start()
            if self.pauses.is_paused(q.dest.id):
                self.echo(
                    f"headwater: destination {q.dest.id}: paused"
                    f" (headwater pipeline resume {q.dest.id} starts it)"
                )
            elif q.dest.mode == "stream":
                self.echo(f"headwater: destination {q.dest.id}: streaming ({q.dest.type})")
            else:
                self.echo(
                    f"headwater: destination {q.dest.id}: batch every {q.dest.batch_period_s:g} s"
                    f" ({q.dest.type})"
                )

    def _supervise(self, q: DestinationQuery) -> None:
        """Run the destination's query until stop(), restarting it after each failure and
        holding it while it is paused."""
        stream = q.dest.mode == "stream"
        try:
            while not self._stop.is_set():
                if self._hold(q):
                    break
                try:
                    if q.stale:
                        self._renew_writer(q)
                    query = self._start(q, available_now=not stream)
                    if query is None:
                        break
                    self._await(q, query)
                except Exception as exc:
                    if self._stop.is_set():
                        break
                    if self._failed(q, exc):
                        break  # stopped for good: only a person can fix what failed
                    continue
                if self._stop.is_set():
                    break
                if self.pauses.is_paused(q.dest.id):
                    continue  # stopped for the pause: held at the top
                if stream:  # stopped by someone else than stop(): start it again
                    log.warning("destination %s: query stopped; restarting it", q.dest.id)
                    self.status.update(q.dest.id, state="retrying")
                    if self._sleep(q, self.backoff.delay(1)):
                        break
                elif self._sleep(q, q.dest.batch_period_s):
                    break
        except BaseException as exc:  # a bug in the supervisor itself: reported by failed()
            q.error = exc
            log.exception("destination %s: supervisor died", q.dest.id)
        finally:
            self.status.update(q.dest.id, state="stopped", next_retry_at=None)
            q.finished.set()

    def _poll(self, q: DestinationQuery) -> bool:
        """Every ``POLL_S`` of a supervisor's waits: write what the status board kept back;
        True when the destination is paused."""
        self.status.flush()
        return self.pauses.is_paused(q.dest.id)

    def _await(self, q: DestinationQuery, query: StreamingQuery) -> None:
        """Wait for the query to end (raising its failure). Once the destination is paused,
        stop the query between batches, as soon as no write is in progress: its offsets are in
        the checkpoint (a batch Spark is planning meanwhile is cut short before its write; it
        runs again on resumption, and the writer's ledger skips a batch that did commit)."""
        stopping = False
        while True:
            try:
                if query.awaitTermination(POLL_S):
                    return
            except Exception:
                if stopping:  # a batch cut short by the pause: it runs again on resumption
                    log.info("destination %s: query ended with an error on pause", q.dest.id)
                    return
                raise
            if stopping or self._stop.is_set() or not self._poll(q):
                continue
            if self._between_batches(q):
                log.info("destination %s: paused; stopping its query", q.dest.id)
                stopping = True
                query.stop()

    def _between_batches(self, q: DestinationQuery) -> bool:
        """Wait until no write is in progress (the end of a write sets it at once); False when
        the destination is resumed or the pipeline stops meanwhile."""
        while not q.idle.wait(POLL_S):
            if self._stop.is_set() or not self._poll(q):
                return False
        return True

    def _sleep(self, q: DestinationQuery, seconds: float) -> bool:
        """Wait ``seconds`` (the next batch-mode run, a retry), less when the destination is
        paused meanwhile; True when the pipeline stops."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(POLL_S, left)):
                return True
            if self._poll(q):
                return False
        return self._stop.is_set()

    def _hold(self, q: DestinationQuery) -> bool:
        """While the destination is paused: its writer closed, its state ``paused``, wait until
        it is resumed; True when the pipeline stops meanwhile."""
        if not self.pauses.is_paused(q.dest.id):
            return False
        try:
            q.writer.close()  # its connection would idle (a DuckDB file would stay locked)
        except Exception:
            log.debug("destination %s: closing the paused writer", q.dest.id, exc_info=True)
            q.stale = True
        self.status.paused(q.dest.id)
        log.info("destination %s: paused", q.dest.id)
        while self._poll(q):
            if self._stop.wait(POLL_S):
                return True
        log.info("destination %s: resumed", q.dest.id)
        return False

    def _failed(self, q: DestinationQuery, exc: Exception) -> bool:
        """Record a failed run, wait the backoff, and give the next run a fresh writer; True
        when the failure stops the destination instead (``stops_destination``: credentials
        the receiver refuses), which is said once, loudly."""
        failure = classify(exc)
        if failure.stops:
            self.status.failed(q.dest.id, failure, 0.0)
            log.error(
                "destination %s stopped: %s: %s; fix its configuration and start headwater again",
                q.dest.id,
                failure.code,
                failure.reason,
            )
            return True
        failures = self.status.get(q.dest.id).consecutive_failures + 1
        delay = self.backoff.delay(failures)
        self.status.failed(q.dest.id, failure, delay)
        what = f"{failure.code}: {failure.reason}" if failure.code else failure.reason
        if failure.transient:
            log.warning(
                "destination %s: write failed (attempt %d, %d in a row): %s; retrying in %.1f s",
                q.dest.id,
                q.runs,
                failures,
                what,
                delay,
            )
        else:
            log.error(
                "destination %s: query failed with an unexpected error (attempt %d, %d in a row):"
                " %s; retrying in %.1f s",
                q.dest.id,
                q.runs,
                failures,
                what,
                delay,
                exc_info=exc,
            )
        q.stale = True
        self._sleep(q, delay)
        return False

    def _renew_writer(self, q: DestinationQuery) -> None:
        """The old writer may hold a broken connection or a stale plan: start afresh (a writer
        that cannot be made is one more failed attempt, retried like the others)."""
        try:
            q.writer.close()
        except Exception:
            log.debug("destination %s: closing the failed writer", q.dest.id, exc_info=True)
        q.writer = writer_for(self.config, q.dest)
        q.stale = False

    def failed(self) -> list[tuple[str, BaseException]]:
        """Destinations whose supervisor died (a bug; failing writers are retried, not here)."""
        return [(q.dest.id, q.error) for q in self.queries if q.error is not None]

    def stop(self) -> None:
        """Stop the queries: a running micro-batch finishes first (its write and its offsets
        commit together, so stopping at any point loses and duplicates nothing)."""
        self._stop.set()
        with self._lock:
            running = [q.query for q in self.queries if q.query is not None]
        for query in running:
            if query.isActive:
                query.stop()
        for q in self.queries:
            if q.thread is not None:
                q.thread.join(timeout=60)
            q.writer.close()
