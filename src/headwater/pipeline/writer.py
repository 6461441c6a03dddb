"""One destination's micro-batch: the steps, the failed store, table patching, the write.

``DestinationWriter`` is the ``foreachBatch`` function of a destination's streaming query.
For each micro-batch (``batch_id`` from the query's checkpoint) it:

1. skips the batch when the destination's ledger already holds it (a replay after a crash);
2. runs the steps: decode, context, lookups, routing, mapping;
3. appends the events a step failed to the failed store (durably, before the write: a crash
   in between makes the same failed ids again, which the store shows once);
4. per target table: infers the fields and their types, plans the columns against the table
   as it is, patches the table (``ensure_table``), and converts the rows to Arrow (an archive,
   ``Destination.archives_events``, takes the events' JSON after context enrichment instead);
5. writes every table's rows and the batch id in one atomic step (``write_batch``); a write
   that fails as terminal sends the batch's events to the failed store instead, a transient
   failure raises so that Spark retries the batch (its offsets are not committed).
"""

from __future__ import annotations

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
from headwater.destinations.base import ARCHIVE_EVENT, ARCHIVE_TIMESTAMP
from headwater.errors import TransientError
from headwater.pipeline.columns import ERROR, EVENT, SOURCE_COLUMNS, TABLE, failure, json_path
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.failed import FailedEvent, FailedStore, make_id, now_iso
from headwater.pipeline.steps.context import enrich_context
from headwater.pipeline.steps.decode import decode
from headwater.pipeline.steps.flatten import infer_fields, merged_schema
from headwater.pipeline.steps.lookup_rules import apply_lookups
from headwater.pipeline.steps.mapping import apply_mapping, explicit_types
from headwater.pipeline.steps.routing import route
from headwater.pipeline.steps.typing import plan_columns, project, target_schema

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

ARCHIVED = "_hw_archive"
WRITE_STEP = "write"
WRITE_FAILED = "HW-PIPE-401"
NULL_KEY = "HW-PIPE-402"


@dataclass
class BatchStats:
    batch_id: int
    rows: int = 0
    written: int = 0
    failed: int = 0
    skipped: int = 0
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


def process(
    df: DataFrame, config: HeadwaterConfig, dest: DestinationConfig, *, archive: bool = False
) -> DataFrame:
    """The steps up to routing and mapping, as one DataFrame -> DataFrame function; with
    ``archive``, ``_hw_archive`` keeps each event's JSON as it was after context enrichment."""
    pipeline = config.pipeline
    out = decode(df, pipeline.protobuf or None)
    out = enrich_context(out)
    if archive:
        out = out.withColumn(ARCHIVED, F.to_json(F.col(EVENT)))
    out = apply_lookups(out, list(dest.enrichment), pipeline.geoip_database)
    out = route(out, dest.table_name_template)
    return apply_mapping(out, dest.mapping)


class DestinationWriter:
    def __init__(self, config: HeadwaterConfig, dest: DestinationConfig) -> None:
        self.config = config
        self.dest = dest
        self.failed = FailedStore(config)
        self._destination: Destination | None = None
        self.last: BatchStats | None = None
        self.batches = 0
        self.written = 0
        self.failed_events = 0
        self.phases: dict[str, float] = {}  # seconds per phase, summed over batches

    @property
    def destination(self) -> Destination:
        if self._destination is None:
            self._destination = open_destination(self.dest, self.config.data_dir)
        return self._destination

    def close(self) -> None:
        if self._destination is not None:
            self._destination.close()
            self._destination = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        stats = BatchStats(batch_id)
        destination = self.destination
        done = destination.committed(self.dest.id)
        if done is not None and batch_id <= done:
            stats.replayed_batch = True
            self.last = stats
            return
        archive = destination.archives_events
        events = process(df, self.config, self.dest, archive=archive).persist()
        try:
            self._write(events, batch_id, destination, stats)
        finally:
            events.unpersist()
        stats.seconds = time.monotonic() - started
        self.last = stats
        self.batches += 1
        self.written += stats.written
        self.failed_events += stats.failed
        for name, seconds in stats.phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds
        log.info(
            "destination %s batch %d: %d rows, %d written to %s, %d failed, %d skipped "
            "(%.2f s: %s)",
            self.dest.id,
            batch_id,
            stats.rows,
            stats.written,
            stats.tables,
            stats.failed,
            stats.skipped,
            stats.seconds,
            ", ".join(f"{k} {v:.2f}" for k, v in stats.phases.items()),
        )

    def _write(
        self, events: DataFrame, batch_id: int, destination: Destination, stats: BatchStats
    ) -> None:
        dialect = destination.dialect
        pk = tuple(dialect.normalize(c) for c in self.dest.primary_key)
        explicit = explicit_types(self.dest.mapping)
        with stats.phase("steps"):  # the steps run here, into the persisted batch
            counts = (
                events.groupBy(F.col(ERROR).isNull().alias("ok"), TABLE)
                .agg(F.count(F.lit(1)).alias("count"), merged_schema().alias("schema"))
                .collect()
            )
        stats.rows = sum(r["count"] for r in counts)
        stats.skipped = sum(r["count"] for r in counts if r["ok"] and not r[TABLE])
        tables = sorted({r[TABLE] for r in counts if r["ok"] and r[TABLE]})
        schemas = {r[TABLE]: r["schema"] for r in counts if r["ok"] and r[TABLE]}
        failed = events.where(F.col(ERROR).isNotNull())
        arrow: dict[str, pa.Table] = {}
        keep = (*SOURCE_COLUMNS, ERROR)
        for name in tables:
            rows = events.where(F.col(ERROR).isNull() & (F.col(TABLE) == name))
            table = dialect.normalize(name)
            if destination.archives_events:
                with stats.phase("project"):
                    arrow[table] = archived(rows).toArrow()
                continue
            with stats.phase("infer"):
                fields = infer_fields(rows, schemas[name])
            existing = destination.table(table)
            plans = plan_columns(fields, dialect, existing, explicit)
            schema = target_schema(table, plans, pk)
            projected = project(rows, plans, keep=keep)
            if pk:
                missing = F.lit(False)
                for c in pk:
                    missing = missing | (F.col(c).isNull() if c in schema.columns else F.lit(True))
                reason = f"the primary key ({', '.join(pk)}) has a null or missing column"
                failed = failed.unionByName(
                    projected.where(missing)
                    .select(*SOURCE_COLUMNS)
                    .withColumn(ERROR, failure(WRITE_STEP, NULL_KEY, reason)),
                    allowMissingColumns=True,
                )
                projected = projected.where(~missing)
            if existing is None or schema.missing_from(existing):
                with stats.phase("patch"):
                    destination.ensure_table(schema)
            with stats.phase("project"):
                arrow[table] = projected.drop(*keep).toArrow()
        if pk or any(not r["ok"] for r in counts):  # else there is nothing to collect
            with stats.phase("failed"):
                self._fail(failed, stats)
        if not arrow:
            destination.write_batch(self.dest.id, batch_id, {})
            return
        try:
            with stats.phase("write"):
                destination.write_batch(self.dest.id, batch_id, arrow)
        except TransientError:
            raise
        except Exception as exc:
            log.error("destination %s batch %d: write failed: %s", self.dest.id, batch_id, exc)
            everything = events.where(F.col(ERROR).isNull() & (F.col(TABLE) != ""))
            self._fail(
                everything.withColumn(ERROR, failure(WRITE_STEP, WRITE_FAILED, str(exc)[:2000])),
                stats,
            )
            destination.write_batch(self.dest.id, batch_id, {})
            return
        for name, t in arrow.items():
            stats.tables[name] = t.num_rows
            stats.written += t.num_rows

    def _fail(self, failed: DataFrame, stats: BatchStats) -> None:
        rows = failed.select(*SOURCE_COLUMNS, ERROR).collect()
        if not rows:
            return
        at = now_iso()
        events = [_failed_event(self.dest.id, r.asDict(), at) for r in rows]
        self.failed.append(events)
        stats.failed += len(events)


def archived(rows: DataFrame) -> DataFrame:
    """An archive's rows (``Destination.archives_events``): the event's JSON after context
    enrichment and its receive time."""
    at = F.try_variant_get(F.col(EVENT), json_path(("_timestamp",)), "timestamp")
    return rows.select(F.col(ARCHIVED).alias(ARCHIVE_EVENT), at.alias(ARCHIVE_TIMESTAMP))


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
