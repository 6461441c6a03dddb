"""One destination's micro-batch: plan, run in the executors, commit on the driver.

``DestinationWriter`` is the ``foreachBatch`` function of a destination's streaming query.
For each micro-batch (``batch_id`` from the query's checkpoint) it:

1. skips the batch when the destination's ledger already holds it (a replay after a crash);
2. for a writer that knows nothing yet, learns a first guess from a sample of the batch;
3. plans the batch from what the destination knows (``headwater.pipeline.plan``) and runs the
   program in the executors (``headwater.pipeline.sink``): one Spark job in which each task
   runs the steps over its rows, stages each table's rows and appends the rows a step failed to
   the failed store;
4. when rows were novel and taught something new, widens the knowledge, discards what was
   staged and goes back to 3 (a batch like the last one never does);
5. creates the batch's tables and adds their missing columns;
6. commits the staged rows and the batch id in one atomic step (``commit_staged``); a commit
   that fails as terminal sends the batch's routed events to the failed store instead (one more
   job), a transient failure raises so that Spark retries the batch (its offsets are not
   committed). No event row passes through the driver.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from headwater.config.model import HeadwaterConfig
from headwater.destinations import Destination, open_destination
from headwater.destinations.base import StagedPart
from headwater.errors import TransientError
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.plan import NULL_KEY, WRITE_STEP, BatchPlan, Knowledge, plan, widen_tables
from headwater.pipeline.positions import Positions
from headwater.pipeline.task import FAIL_ALL, FAIL_NOVEL, LEARN, Summary, TaskRun
from headwater.pipeline.timing import timed

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from headwater.pipeline.sink import SinkResult

log = logging.getLogger(__name__)

WRITE_FAILED = "HW-PIPE-401"
FIRST_SAMPLE = 2_000  # events a writer that knows nothing learns its first guess from
MAX_PLANS = 4  # a batch is planned at most this often (each plan learns from novel rows)
__all__ = ["NULL_KEY", "WRITE_FAILED", "BatchStats", "DestinationWriter", "WriterBase"]


@dataclass
class BatchStats:
    batch_id: int
    rows: int = 0
    written: int = 0
    failed: int = 0
    skipped: int = 0
    novel: int = 0
    plans: int = 0
    tasks: int = 0  # Spark tasks that staged rows (the batch's parallelism)
    tables: dict[str, int] = field(default_factory=dict)
    replayed_batch: bool = False
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase

    def phase(self, name: str) -> AbstractContextManager[None]:
        return timed(self.phases, name)


class Ledgered(Protocol):
    """What a writer needs of its destination whatever it writes: its ledger and its staging."""

    def committed(self, writer_id: str) -> int | None: ...

    def clean_staging(self, writer_id: str) -> None: ...

    def close(self) -> None: ...


class Replayable(Protocol):
    """What a writer needs of a batch's figures whatever it writes."""

    batch_id: int
    replayed_batch: bool


DestinationT = TypeVar("DestinationT", bound=Ledgered)
StatsT = TypeVar("StatsT", bound=Replayable)


class WriterBase(Generic[DestinationT, StatsT]):
    """What every writer of a destination's query (the events' ``DestinationWriter``, transport's
    ``MirrorWriter``) holds: its destination, opened on first use with what a crashed run staged
    removed, its last batch's figures and its totals."""

    def __init__(self, config: HeadwaterConfig, dest: DestinationConfig) -> None:
        self.config = config
        self.dest = dest
        self._destination: DestinationT | None = None
        self.last: StatsT | None = None
        self.batches = 0
        self.written = 0
        self.failed_events = 0

    def _open(self) -> DestinationT:
        raise NotImplementedError

    def _new_stats(self, batch_id: int) -> StatsT:
        raise NotImplementedError

    def _write(self, df: DataFrame, stats: StatsT, started: float) -> None:
        """Write the batch (``started``: when it began, by ``time.monotonic``)."""
        raise NotImplementedError

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch``'s function: the batch written, unless the ledger holds it already."""
        started = time.monotonic()
        stats = self._new_stats(batch_id)
        if not self._replayed(stats):
            self._write(df, stats, started)

    @property
    def destination(self) -> DestinationT:
        if self._destination is None:
            destination = self._open()
            destination.clean_staging(self.dest.id)  # what a crashed run staged is not wanted
            self._destination = destination
        return self._destination

    def close(self) -> None:
        if self._destination is not None:
            self._destination.close()
            self._destination = None

    def _replayed(self, stats: StatsT) -> bool:
        """Whether the destination's ledger holds the batch already (a replay after a crash):
        then it is marked replayed, as the last batch, and there is nothing to write."""
        done = self.destination.committed(self.dest.id)
        if done is not None and stats.batch_id <= done:
            stats.replayed_batch = True
            self.last = stats
            return True
        return False


class DestinationWriter(WriterBase[Destination, BatchStats]):
    def __init__(self, config: HeadwaterConfig, dest: DestinationConfig) -> None:
        super().__init__(config, dest)
        self.knowledge_path = config.checkpoint_dir() / f"{dest.id}.knowledge.json"
        self.knowledge = Knowledge.load(self.knowledge_path)
        self.phases: dict[str, float] = {}  # seconds per phase, summed over batches

    def _open(self) -> Destination:
        return open_destination(self.dest, self.config.data_dir)

    def plan(self) -> BatchPlan:
        state = self.config.checkpoint_dir()
        return plan(self.knowledge, self.dest, self.destination, self.config.pipeline, state)

    def _new_stats(self, batch_id: int) -> BatchStats:
        return BatchStats(batch_id)

    def _write(self, df: DataFrame, stats: BatchStats, started: float) -> None:
        from headwater.pipeline import sink

        batch_id = stats.batch_id
        destination = self.destination
        with stats.phase("plan"):
            df, ranges = sink.task_frame(df)
            if ranges != [] and destination.session_paths:
                df = sink.session_frame(df, ranges, list(destination.session_paths))
        if ranges == []:  # nothing in the batch: record it, no job
            destination.commit_staged(self.dest.id, batch_id, [], {})
            self._done(stats)
            return
        if not self.knowledge.shape.leaves:  # a new writer: a first guess from a sample
            with stats.phase("learn"):
                self._learn_first(ranges)
        # a destination that delivers cannot take back what a run sent: each run sends the
        # rows the plan describes whole and holds the novel ones back for the next run, which
        # sends only those (held) once the plan has learned them (or as they are, at the end)
        delivers = destination.delivers
        only: Positions | None = None
        final = False
        sent = Sent()
        while True:
            stats.plans += 1
            with stats.phase("plan"):
                planned = self.plan()
            hold = delivers and not final and stats.plans < MAX_PLANS
            try:
                with stats.phase("run"):
                    result = sink.run(
                        df,
                        self.config,
                        self.dest,
                        batch_id,
                        planned.program,
                        hold_novel=hold,
                        only=only,
                    )
            except Exception as exc:
                if not _refused(exc):
                    raise  # transient or unknown (a lost executor): the batch is retried
                self._fail_batch(df, batch_id, planned, exc, stats)
                stats.seconds = time.monotonic() - started
                self._done(stats)
                return
            summary = result.summary
            for name, seconds in summary.seconds.items():  # the tasks' time, summed
                stats.phases[f"task {name}"] = stats.phases.get(f"task {name}", 0.0) + seconds
            sent.add(result)
            if summary.novel and stats.plans < MAX_PLANS and not final:
                with stats.phase("learn"):
                    learned = self.knowledge.learn(summary.leaves, summary.seen, self.dest)
                if learned:
                    self.knowledge.save(self.knowledge_path)
                    if not delivers:
                        destination.discard_staged(self.dest.id, batch_id, result.parts)
                        continue
                    if summary.held:
                        only = summary.held
                        continue
            if delivers and summary.held:  # nothing more to learn: send them as they are
                only, final = summary.held, True
                continue
            break
        if delivers:  # every run's sent rows, not only the last run's
            result, summary.tables = sent.result(summary), dict(sent.tables)
        if summary.novel_failed:  # novel rows that failed stay failed: nothing more to learn
            with stats.phase("failed"):
                sink.run(df, self.config, self.dest, batch_id, planned.program, mode=FAIL_NOVEL)
        stats.rows, stats.novel, stats.failed = summary.rows, summary.novel, summary.failed
        stats.skipped = summary.skipped
        present = [tp for tp in planned.tables.values() if tp.schema.name in summary.tables]
        try:
            with stats.phase("patch"):
                widen_tables(destination, present)
            with stats.phase("commit"):
                schemas = {tp.schema.name: tp.schema for tp in present}
                destination.commit_staged(self.dest.id, batch_id, result.parts, schemas)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                destination.discard_staged(self.dest.id, batch_id, result.parts)
            if not isinstance(exc, Exception) or _transient(exc):
                raise
            self._fail_batch(df, batch_id, planned, exc, stats)
        else:
            stats.tables = dict(summary.tables)
            stats.written = sum(summary.tables.values())
            stats.tasks = len({p.task for p in result.parts})
            # a task attempt that died with its executor staged a part nobody committed: the
            # batch is in, so whatever of this writer is still staged is such a leftover
            with stats.phase("clean"):
                try:
                    destination.clean_staging(self.dest.id)
                except Exception as exc:  # committed already: leftovers wait for the next start
                    log.warning("destination %s: staging not cleaned: %s", self.dest.id, exc)
        stats.seconds = time.monotonic() - started
        self._done(stats)

    def _learn_first(self, ranges: list[dict[str, Any]] | None) -> None:
        """Widen the knowledge from ``FIRST_SAMPLE`` events, read here from the log (the first
        of each of the batch's ranges, else of the destination's topics) and run in-process
        (a guess: whatever the batch holds beyond it is novel and learned by the tasks): their
        leaves, then the fields each table gets."""
        from headwater.pipeline import sink

        if ranges is not None:
            sample = sink.sample(ranges, self.config, FIRST_SAMPLE)
        else:
            sample = first_events(self.config, self.dest, FIRST_SAMPLE)
        if not sample:
            return
        for _ in range(2):  # the shape, then what the planned fields hold per table
            summary: Summary = TaskRun(self.plan().program, self.dest.id, LEARN).run(sample)
            if not self.knowledge.learn(summary.leaves, summary.seen, self.dest):
                break
        self.knowledge.save(self.knowledge_path)

    def _fail_batch(
        self,
        df: DataFrame,
        batch_id: int,
        planned: BatchPlan,
        exc: Exception,
        stats: BatchStats,
    ) -> None:
        """The destination refused the batch for good: its routed events go to the failed
        store (one more job) and the batch is recorded as done, empty."""
        from headwater.pipeline import sink

        log.error("destination %s batch %d: write failed: %s", self.dest.id, batch_id, exc)
        why = (WRITE_STEP, WRITE_FAILED, str(exc)[:2000])
        result = sink.run(
            df, self.config, self.dest, batch_id, planned.program, mode=FAIL_ALL, failure=why
        )
        stats.failed += sum(result.summary.tables.values())
        self.destination.write_batch(self.dest.id, batch_id, {})

    def _done(self, stats: BatchStats) -> None:
        self.last = stats
        self.batches += 1
        self.written += stats.written
        self.failed_events += stats.failed
        for name, seconds in stats.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds
        log.info(
            "destination %s batch %d: %d rows, %d written to %s, %d failed, %d skipped, "
            "%d novel, %d plan(s), %d task(s) (%.2f s: %s)",
            self.dest.id,
            stats.batch_id,
            stats.rows,
            stats.written,
            stats.tables,
            stats.failed,
            stats.skipped,
            stats.novel,
            stats.plans,
            stats.tasks,
            stats.seconds,
            ", ".join(f"{k} {v:.2f}" for k, v in stats.phases.items()),
        )


@dataclass
class Sent:
    """What the runs of one batch of a delivering destination sent, together."""

    parts: list[StagedPart] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)

    def add(self, result: SinkResult) -> None:
        self.parts += result.parts
        for table, n in result.summary.tables.items():
            self.tables[table] = self.tables.get(table, 0) + n

    def result(self, summary: Summary) -> SinkResult:
        from headwater.pipeline.sink import SinkResult

        return SinkResult(list(self.parts), summary)


def first_events(config: HeadwaterConfig, dest: DestinationConfig, n: int) -> list[pa.RecordBatch]:
    """About ``n`` of the earliest records of the destination's topics, read from the bus (a
    share of each partition), in the source's Arrow layout."""
    from headwater.bus import open_bus
    from headwater.pipeline.source.offsets import select_topics

    out: list[pa.RecordBatch] = []
    with open_bus(config, read_only=True) as bus:
        pattern = None if dest.topics else dest.topic_pattern
        internal = {config.pipeline.failed_topic}
        chosen = select_topics((t.name for t in bus.topics()), dest.topics, pattern, internal)
        parts = [(t, p) for t in chosen for p in range(bus.topic(t).partitions)]
        for topic, partition in parts:
            low, high = bus.watermarks(topic, partition)
            share = max(n // len(parts), 1)
            out += bus.read_arrow(topic, partition, low, min(high, low + share), share)
    return out


def _refused(exc: BaseException) -> bool:
    """A task's destination refused the rows for good (a terminal ``HW-DST-...`` error, as it
    surfaces from the Spark job)."""
    from headwater.pipeline.status import classify

    failure = classify(exc)
    return bool(failure.code and failure.code.startswith("HW-DST-") and not failure.transient)


def _transient(exc: BaseException) -> bool:
    """A failure a retry may fix, also when it surfaces from a Spark task as text (a task's
    ``TransientError`` reaches the driver inside Spark's own exception)."""
    return isinstance(exc, TransientError) or any(c in str(exc) for c in _TRANSIENT_CODES)


_TRANSIENT_CODES = ("HW-DST-002", "HW-DST-003")
