"""One destination's micro-batch: plan, write, commit.

``DestinationWriter`` is the ``foreachBatch`` function of a destination's streaming query.
For each micro-batch (``batch_id`` from the query's checkpoint) it:

1. skips the batch when the destination's ledger already holds it (a replay after a crash);
2. plans the batch from what the destination knows (``headwater.pipeline.plan``): the steps
   run as native expressions against the carried shape, and every row gets its table's
   columns, typed against the table as it is, or is marked novel;
3. when rows are novel, widens the knowledge from those rows only and plans again (a batch
   like the last one never does);
4. creates the batch's tables and adds their missing columns;
5. appends the events a step failed to the failed store (durably, before the write: a crash
   in between makes the same failed ids again, which the store shows once);
6. writes every table's rows and the batch id in one atomic step (``write_batch``); a write
   that fails as terminal sends the batch's events to the failed store instead, a transient
   failure raises so that Spark retries the batch (its offsets are not committed).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.config.model import HeadwaterConfig
from headwater.destinations import Destination, open_destination
from headwater.errors import TransientError
from headwater.pipeline.columns import ERROR, NOVEL, SOURCE_COLUMNS, TABLE, failure
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.failed import FailedEvent, FailedStore, make_id, now_iso
from headwater.pipeline.plan import (
    NULL_KEY,
    ORDER,
    SOURCE,
    WRITE_STEP,
    BatchPlan,
    Knowledge,
    TablePlan,
    learn_first,
    learn_shape,
    learn_tables,
    steps,
    widen_tables,
)

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

WRITE_FAILED = "HW-PIPE-401"
# Novel rows are learned from a sample first (inference costs far more per row than the
# batch's own pass), then from all of them: a batch is planned until nothing is left to learn.
SAMPLES = (2_000, 20_000)
__all__ = ["NULL_KEY", "WRITE_FAILED", "BatchStats", "DestinationWriter"]


@dataclass
class BatchStats:
    batch_id: int
    rows: int = 0
    written: int = 0
    failed: int = 0
    skipped: int = 0
    novel: int = 0
    plans: int = 0
    tables: dict[str, int] = field(default_factory=dict)
    replayed_batch: bool = False
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (see _write)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - started


class DestinationWriter:
    def __init__(self, config: HeadwaterConfig, dest: DestinationConfig) -> None:
        self.config = config
        self.dest = dest
        self.failed = FailedStore(config)
        self.knowledge_path = config.checkpoint_dir() / f"{dest.id}.knowledge.json"
        self.knowledge = Knowledge.load(self.knowledge_path)
        self._destination: Destination | None = None
        self.last: BatchStats | None = None
        self.batches = 0
        self.written = 0
        self.failed_events = 0
        self.phases: dict[str, float] = {}  # seconds per phase, summed over batches

    @property
    def destination(self) -> Destination:
        if self._destination is None:
            destination = open_destination(self.dest, self.config.data_dir)
            if stages(destination):  # what a crashed run of this writer staged is not wanted
                destination.clean_staging(self.dest.id)
            self._destination = destination
        return self._destination

    def close(self) -> None:
        if self._destination is not None:
            self._destination.close()
            self._destination = None

    def plan(self, df: DataFrame) -> BatchPlan:
        pipeline = self.config.pipeline
        events = steps(
            df,
            self.dest,
            self.knowledge.shape,
            protobuf=dict(pipeline.protobuf) or None,
            geoip_database=pipeline.geoip_database,
        )
        return BatchPlan(events, self.knowledge, self.dest, self.destination)

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        stats = BatchStats(batch_id)
        destination = self.destination
        done = destination.committed(self.dest.id)
        if done is not None and batch_id <= done:
            stats.replayed_batch = True
            self.last = stats
            return
        if not self.knowledge.shape.leaves:  # a new writer: a first guess from a sample
            with stats.phase("learn"):
                if learn_first(df, self.knowledge.shape, SAMPLES[0]):
                    self.knowledge.save(self.knowledge_path)
        for attempt in itertools.count():
            stats.plans += 1
            with stats.phase("plan"):
                plan = self.plan(df)
                frame = plan.frame().persist()
            try:
                with stats.phase("steps"):  # the steps run here, into the cached frame
                    summary = plan.summary(frame)
                novel = sum(r["count"] for r in summary if r[NOVEL])
                if novel:
                    with stats.phase("learn"):
                        sample = SAMPLES[attempt] if attempt < len(SAMPLES) else None
                        learned = self._learn(frame, plan, summary, sample)
                        if not learned and sample is not None:
                            learned = self._learn(frame, plan, summary, None)
                    if learned:
                        self.knowledge.save(self.knowledge_path)
                        continue
                stats.novel = novel
                self._write(frame, plan, summary, batch_id, destination, stats)
                break
            finally:
                frame.unpersist()
        stats.seconds = time.monotonic() - started
        self.last = stats
        self.batches += 1
        self.written += stats.written
        self.failed_events += stats.failed
        for name, seconds in stats.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds
        log.info(
            "destination %s batch %d: %d rows, %d written to %s, %d failed, %d skipped, "
            "%d plan(s) (%.2f s: %s)",
            self.dest.id,
            batch_id,
            stats.rows,
            stats.written,
            stats.tables,
            stats.failed,
            stats.skipped,
            stats.plans,
            stats.seconds,
            ", ".join(f"{k} {v:.2f}" for k, v in stats.phases.items()),
        )

    def _learn(
        self, frame: DataFrame, plan: BatchPlan, summary: list[Any], sample: int | None
    ) -> bool:
        """Widen the knowledge from the batch's novel rows (the first ``sample`` of them, or
        all); True when anything was new (the batch is then planned again). Rows that stay
        novel when all of them teach nothing new (the cheap check can call a row novel that
        fits) are written as they are."""
        tables = learn_tables(plan, summary, self.knowledge)
        return learn_shape(frame, self.knowledge.shape, sample) or tables

    def _write(
        self,
        frame: DataFrame,
        plan: BatchPlan,
        counts: list[Any],
        batch_id: int,
        destination: Destination,
        stats: BatchStats,
    ) -> None:
        stats.rows = sum(r["count"] for r in counts)
        stats.skipped = sum(r["count"] for r in counts if r["ok"] and not r[TABLE])
        rows_per_table: dict[str, int] = {}
        for r in counts:
            if r["ok"] and r[TABLE]:
                rows_per_table[r[TABLE]] = rows_per_table.get(r[TABLE], 0) + r["count"]
        present = {n: tp for n, tp in plan.tables.items() if tp.schema.name in rows_per_table}
        with stats.phase("patch"):
            widen_tables(destination, present)
        if any(not r["ok"] for r in counts):
            with stats.phase("failed"):
                self._fail(frame.where(F.col(ERROR).isNotNull()), stats)
        tables = {tp.schema.name: tp for tp in present.values()}
        try:
            with stats.phase("write"):
                if stages(destination):
                    self._stage_and_commit(frame, tables, batch_id, destination)
                else:
                    destination.write_batch(self.dest.id, batch_id, _arrow(frame, tables))
        except TransientError:
            raise
        except Exception as exc:
            if _transient(exc):
                raise
            log.error("destination %s batch %d: write failed: %s", self.dest.id, batch_id, exc)
            # every routed row: their source records come from the batch itself
            everything = plan.events.where(F.col(ERROR).isNull() & (F.col(TABLE) != ""))
            self._fail(
                everything.withColumn(
                    ERROR, failure(WRITE_STEP, WRITE_FAILED, str(exc)[:2000])
                ).select(F.struct(*SOURCE_COLUMNS).alias(SOURCE), ERROR),
                stats,
            )
            destination.write_batch(self.dest.id, batch_id, {})
            return
        for name in tables:
            stats.tables[name] = rows_per_table[name]
            stats.written += rows_per_table[name]

    def _stage_and_commit(
        self,
        frame: DataFrame,
        tables: dict[str, TablePlan],
        batch_id: int,
        destination: Destination,
    ) -> None:
        """Executors stage the rows (``headwater_sink``); the driver commits them with the
        ledger in one step. Nothing staged is visible unless committed."""
        from headwater.pipeline.sink import stage_frame

        frame_columns = sorted({fc for tp in tables.values() for _, fc in tp.columns})
        rows = frame.where(F.col(TABLE) != "").select(TABLE, ORDER, *frame_columns)
        layout = {name: [list(pair) for pair in tp.columns] for name, tp in tables.items()}
        parts = stage_frame(rows, self.config, self.dest, batch_id, layout)
        try:
            schemas = {name: tp.schema for name, tp in tables.items()}
            destination.commit_staged(self.dest.id, batch_id, parts, schemas)
        except BaseException:
            with contextlib.suppress(Exception):
                destination.discard_staged(self.dest.id, batch_id, parts)
            raise

    def _fail(self, failed: DataFrame, stats: BatchStats) -> None:
        rows = failed.select(f"{SOURCE}.*", ERROR).collect()
        if not rows:
            return
        at = now_iso()
        events = [_failed_event(self.dest.id, r.asDict(), at) for r in rows]
        self.failed.append(events)
        stats.failed += len(events)


def _failed_event(destination: str, row: dict[str, Any], at: str) -> FailedEvent:
    error = row[ERROR]
    headers = tuple((h["key"], bytes(h["value"] or b"")) for h in row["headers"] or [])
    return FailedEvent(
        id=make_id(destination, row["topic"], row["partition"], row["offset"]),
        destination=destination,
        step=error["step"],
        code=error["code"],
        reason=error["reason"] or "",
        topic=row["topic"],
        partition=row["partition"],
        offset=row["offset"],
        failed_at=at,
        key=None if row["key"] is None else bytes(row["key"]),
        value=bytes(row["value"] or b""),
        headers=headers,
    )


def stages(destination: Destination) -> bool:
    """Whether the destination stages rows from Spark tasks (else the driver writes)."""
    return type(destination).stage is not Destination.stage


def _arrow(frame: DataFrame, tables: dict[str, TablePlan]) -> dict[str, pa.Table]:
    """Every table's rows through the driver (destinations that cannot stage)."""
    out = {}
    for name, tp in tables.items():
        rows = frame.where(F.col(TABLE) == name)
        if tp.schema.primary_key:
            rows = rows.orderBy(ORDER)
        out[name] = rows.select(*[F.col(fc).alias(c) for c, fc in tp.columns]).toArrow()
    return out


def _transient(exc: BaseException) -> bool:
    """A failure a retry may fix, also when it surfaces from a Spark task as text (a task's
    ``TransientError`` reaches the driver inside Spark's own exception)."""
    return isinstance(exc, TransientError) or any(c in str(exc) for c in _TRANSIENT_CODES)


_TRANSIENT_CODES = ("HW-DST-002", "HW-DST-003")
