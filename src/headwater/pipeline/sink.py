"""The ``headwater_sink`` Spark data source: executors run a micro-batch's program over their
rows and stage the result into the destination; the driver gets back what they staged and what
they learned, to commit with its ledger.

Issue 8's rule is that no event row travels through the driver. Inside ``foreachBatch`` the
writer saves the batch's source frame (the log's records, untouched) with
``format("headwater_sink")``; each Spark task (``write``) runs the batch's ``Program``
(``headwater.pipeline.task``: the steps as one DuckDB query per chunk of its Arrow batches),
stages each table's rows in chunks (``Destination.stage``, in the task's own Python worker),
appends the rows a step failed to the failed store, and returns the parts and a ``Summary`` as
its commit message. Spark calls ``commit`` with every task's message once all succeeded, in a
Python worker on the driver's machine, not in the driver's interpreter: it writes them to the
``manifest`` file (atomically, by rename), which :func:`run` reads back. ``abort`` (a task failed
for good) discards the parts the finished tasks staged; a failing task discards its own before
it fails; a task Spark cancels (its worker is killed) cannot, so :func:`run` cleans the
writer's staging when the job fails (and the writer calls ``clean_staging`` when it starts).
Nothing staged here is visible before the caller commits it (``Destination.commit_staged``).

Options: ``config`` (``HeadwaterConfig`` as JSON), ``destination`` (its id, also the ledger's
writer id), ``batch_id``, ``program`` (``Program`` as JSON), ``manifest`` (a path on the
driver's machine), ``mode`` (``task.MODES``), and for ``fail_all`` the ``failure`` (JSON
``[step, code, reason]``); optionally ``chunkRows`` (rows per query and per staged part), and
for destinations that deliver, ``holdNovel`` and ``only`` (``Positions`` as JSON: see
``TaskRun``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, WriterCommitMessage

from headwater.pipeline.positions import Positions
from headwater.pipeline.program import CHUNK_ROWS, MODES, WRITE, Program

try:  # PySpark 4.0+ hands Arrow batches to an Arrow writer
    from pyspark.sql.datasource import DataSourceArrowWriter as _Writer
except ImportError:  # pragma: no cover - older PySpark: rows
    from pyspark.sql.datasource import DataSourceWriter as _Writer

if TYPE_CHECKING:  # the rest is imported where it is used: the processes in which Spark plans
    # and commits the write load this module too, and need none of it
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from headwater.config.model import HeadwaterConfig
    from headwater.delivery.frame import Buckets
    from headwater.destinations import Destination
    from headwater.destinations.base import StagedPart
    from headwater.pipeline.config import DestinationConfig
    from headwater.pipeline.failed import FailedEvent, FailedStore
    from headwater.pipeline.task import Summary

log = logging.getLogger(__name__)

SINK_NAME = "headwater_sink"
WARM_OPTION = "warm"  # set: the writer does nothing (see WarmWriter)
MAIN_BUS, FAILED_BUS = "main", "failed"  # the buses ranges of records are on
BUCKET, BUCKETS = "bucket", "buckets"  # a range row's bucket (see headwater.delivery.frame)

_destinations: dict[tuple[str, str], Destination] = {}
_destinations_lock = threading.Lock()


def register(spark: SparkSession) -> None:
    """Make ``format("headwater_sink")`` available on ``spark``."""
    spark.dataSource.register(HeadwaterSink)


def destination_for(config_json: str, destination_id: str) -> Destination:
    """This process's instance of a configured destination (opened on first use; a Python
    worker runs many tasks)."""
    from headwater.config.model import HeadwaterConfig
    from headwater.destinations import open_destination

    key = (config_json, destination_id)
    with _destinations_lock:
        dest = _destinations.get(key)
        if dest is None:
            config = HeadwaterConfig.model_validate_json(config_json)
            dest = open_destination(destination_config(config, destination_id), config.data_dir)
            _destinations[key] = dest
        return dest


def destination_config(config: HeadwaterConfig, destination_id: str) -> DestinationConfig:
    for dest in config.pipeline.destinations:
        if dest.id == destination_id:
            return dest
    raise KeyError(f"no destination {destination_id!r} in the configuration")


@dataclass
class StagedMessage(WriterCommitMessage):
    """A task's commit message: the parts it staged and its summary, as JSON objects."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SinkOptions:
    config_json: str
    destination: str
    batch_id: int
    program: Program
    manifest: str
    mode: str
    failure: tuple[str, str, str] | None
    chunk_rows: int
    hold_novel: bool = False
    only: Positions | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        wanted = ("config", "destination", "batch_id", "program", "manifest")
        missing = [k for k in wanted if k not in options]
        if missing:
            raise ValueError(f"{SINK_NAME}: missing option(s) {', '.join(missing)}")
        mode = options.get("mode", WRITE)
        if mode not in MODES:
            raise ValueError(f"{SINK_NAME}: unknown mode {mode!r} (one of {', '.join(MODES)})")
        failure = json.loads(options["failure"]) if "failure" in options else None
        return cls(
            config_json=options["config"],
            destination=options["destination"],
            batch_id=int(options["batch_id"]),
            program=Program.from_json(options["program"]),
            manifest=options["manifest"],
            mode=mode,
            failure=tuple(failure) if failure else None,  # type: ignore[arg-type]
            chunk_rows=int(options.get("chunkRows", CHUNK_ROWS)),
            hold_novel=options.get("holdNovel") == "true",
            only=Positions.from_json(json.loads(options["only"])) if "only" in options else None,
        )


class HeadwaterSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return SINK_NAME

    def writer(self, schema: StructType, overwrite: bool) -> _Writer:
        if WARM_OPTION in self.options:
            return WarmWriter()
        return SinkWriter(SinkOptions.parse(self.options))


class WarmWriter(_Writer):  # type: ignore[misc,valid-type]
    """Writes and commits nothing: a job through it starts the Python processes that plan,
    run and commit the sink's writes before the first batch needs them (``spark.warm_workers``)."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        pass


class SinkWriter(_Writer):  # type: ignore[misc,valid-type]
    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedMessage:
        from headwater.pipeline.task import release_memory

        try:
            return self._write(iterator)
        finally:
            release_memory()  # the worker idles until its next task: small meanwhile

    def _write(self, iterator: Iterator[pa.RecordBatch]) -> StagedMessage:
        from headwater.config.model import HeadwaterConfig
        from headwater.pipeline.failed import FailedStore, now_iso
        from headwater.pipeline.plan import DELIVER_STEP
        from headwater.pipeline.task import TaskRun, failed_event

        opts = self.options
        staged: list[StagedPart] = []
        dest = destination_for(opts.config_json, opts.destination) if opts.mode == WRITE else None
        task = task_name()
        store: list[FailedStore] = []

        def stage(tables: dict[str, pa.Table]) -> None:
            assert dest is not None
            staged.extend(dest.stage(opts.destination, opts.batch_id, task, tables))

        def fail(events: list[FailedEvent]) -> None:
            if not store:
                store.append(FailedStore(HeadwaterConfig.model_validate_json(opts.config_json)))
            store[0].append(events)

        run = TaskRun(
            opts.program,
            opts.destination,
            opts.mode,
            on_rows=stage,
            on_failed=fail,
            chunk_rows=opts.chunk_rows,
            failure=opts.failure,
            hold_novel=opts.hold_novel,
            only=opts.only,
        )

        def given_up(events: list[tuple[dict[str, Any], str, str]]) -> None:
            at = now_iso()
            fail(
                [
                    failed_event(opts.destination, record, DELIVER_STEP, code, reason, at)
                    for record, code, reason in events
                ]
            )

        try:
            summary = run.run(records(iterator, opts.config_json))
            if dest is not None:
                staged += dest.finish_stage(opts.destination, opts.batch_id, task, given_up)
        except BaseException:
            if dest is not None:
                with contextlib.suppress(Exception):  # the failure below is the one to report
                    dest.finish_stage(opts.destination, opts.batch_id, task, given_up, abandon=True)
                    if staged:
                        dest.discard_staged(opts.destination, opts.batch_id, staged)
            raise
        return StagedMessage([p.to_json() for p in staged], summary.to_json())

    def commit(self, messages: list[StagedMessage | None]) -> None:  # type: ignore[override]
        done = [m for m in messages if m is not None]
        write_manifest(
            Path(self.options.manifest),
            {"parts": [p for m in done for p in m.parts], "summaries": [m.summary for m in done]},
        )

    def abort(self, messages: list[StagedMessage | None]) -> None:  # type: ignore[override]
        from headwater.destinations.base import StagedPart

        opts = self.options
        parts = [StagedPart.from_json(p) for m in messages if m is not None for p in m.parts]
        if parts:
            dest = destination_for(opts.config_json, opts.destination)
            dest.discard_staged(opts.destination, opts.batch_id, parts)
        log.warning(
            "%s: batch %d of %s aborted, %d staged part(s) discarded",
            SINK_NAME,
            opts.batch_id,
            opts.destination,
            len(parts),
        )


def task_frame(df: DataFrame) -> tuple[DataFrame, list[dict[str, Any]] | None]:
    """The frame the sink's job runs over, and the batch's ranges of records when the source
    gave ranges (else None: the frame is the records). Ranges are collected (a row each) and
    laid out again in Spark's JVM (``ranges_frame``): the job's tasks then need no Python worker
    to read them, only the sink's, which reads the records itself."""
    if "start" not in df.columns:
        return df, None
    ranges = [r.asDict() for r in df.collect()]
    if not ranges:
        return df, ranges
    return ranges_frame(df.sparkSession, ranges), ranges


def ranges_frame(
    spark: SparkSession, ranges: list[dict[str, Any]], buckets: Buckets | None = None
) -> DataFrame:
    """One partition per range; with ``buckets``, one partition per bucket instead, each with
    every range and its bucket's number (``records`` keeps the bucket's records only)."""
    from pyspark.sql import functions as F

    table = F.array(
        *[
            F.struct(
                F.lit(r["bus"]).alias("bus"),
                F.lit(r["topic"]).alias("topic"),
                F.lit(r["partition"]).cast("int").alias("partition"),
                F.lit(r["start"]).cast("long").alias("start"),
                F.lit(r["end"]).cast("long").alias("end"),
            )
            for r in ranges
        ]
    )
    n = len(ranges)
    if buckets is None:
        ids = spark.range(0, n, 1, n)
        return ids.select(F.get(table, F.col("id").cast("int")).alias("r")).select("r.*")
    ids = spark.range(0, n * buckets.count, 1, buckets.count)  # partition i: ids i*n .. i*n+n-1
    return ids.select(
        F.get(table, (F.col("id") % n).cast("int")).alias("r"),
        (F.col("id") / n).cast("int").alias(BUCKET),
        F.lit(buckets.to_json()).alias(BUCKETS),
    ).select("r.*", BUCKET, BUCKETS)


def records(batches: Iterator[pa.RecordBatch], config_json: str) -> Iterator[pa.RecordBatch]:
    """The task's records in the source's layout: as Spark gives them, or read here from the
    bus for rows that are ranges of records (``source.RANGES_SCHEMA_DDL``): so the records
    never pass through the JVM."""
    buses = Buses(config_json)
    for batch in batches:
        if "start" not in batch.schema.names:
            yield batch
            continue
        for row in batch.to_pylist():
            if BUCKET in row:
                from headwater.delivery.frame import Buckets, bucket_records

                buckets = Buckets.from_json(row[BUCKETS])
                yield from bucket_records(buses.read(row), buckets, row[BUCKET])
            else:
                yield from buses.read(row)


class Buses:
    """The buses ranges of records are on (``MAIN_BUS``, ``FAILED_BUS``), by config."""

    def __init__(self, config_json: str) -> None:
        self.config_json = config_json
        self.configs: dict[str, str] = {}

    def read(self, row: Mapping[str, Any], limit: int | None = None) -> Iterator[pa.RecordBatch]:
        """The records of a range (at most ``limit`` of its first)."""
        from headwater.pipeline.failed import failed_config
        from headwater.pipeline.source import offsets as off
        from headwater.pipeline.source.reader import LogRange, read_range

        bus = row["bus"]
        if bus not in self.configs:
            from headwater.config.model import HeadwaterConfig

            config = HeadwaterConfig.model_validate_json(self.config_json)
            on = config if bus == MAIN_BUS else failed_config(config)
            self.configs[bus] = on.model_dump_json()
        end = row["end"] if limit is None else min(row["end"], row["start"] + limit)
        r = off.Range(row["topic"], row["partition"], row["start"], end)
        yield from read_range(LogRange(self.configs[bus], r))


def sample(ranges: list[dict[str, Any]], config: HeadwaterConfig, n: int) -> list[pa.RecordBatch]:
    """About ``n`` records: the first ones of each range, in the driver (a first guess)."""
    buses = Buses(config.model_dump_json())
    share = max(n // max(len(ranges), 1), 1)
    return [b for r in ranges for b in buses.read(r, share)]


def task_name() -> str:
    """``s<stage>p<partition>a<attempt>`` of the running Spark task (for logs; the staging
    names' uniqueness does not rest on it)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return f"local-{uuid.uuid4().hex[:8]}"
    return f"s{ctx.stageId()}p{ctx.partitionId()}a{ctx.attemptNumber()}"


def write_manifest(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, path)


@dataclass(frozen=True)
class SinkResult:
    parts: list[StagedPart]
    summary: Summary


def run(
    frame: DataFrame,
    config: HeadwaterConfig,
    dest: DestinationConfig,
    batch_id: int,
    program: Program,
    *,
    mode: str = WRITE,
    failure: tuple[str, str, str] | None = None,
    chunk_rows: int | None = None,
    hold_novel: bool = False,
    only: Positions | None = None,
) -> SinkResult:
    """Run ``program`` over ``frame`` (the source's rows) in the executors: one Spark job.
    Returns the staged parts (``mode`` write) and the tasks' summaries merged. Raises what the
    job raised (the parts of an aborted job are discarded)."""
    from headwater.destinations.base import StagedPart
    from headwater.pipeline.task import Summary

    fd, name = tempfile.mkstemp(prefix=f"hw-sink-{dest.id}-{batch_id}-", suffix=".json")
    os.close(fd)
    manifest = Path(name)
    manifest.unlink()  # only the commit makes it
    config_json = config.model_dump_json()
    try:
        writer = (
            frame.write.format(SINK_NAME)
            .mode("append")
            .option("config", config_json)
            .option("destination", dest.id)
            .option("batch_id", str(batch_id))
            .option("program", program.to_json())
            .option("manifest", str(manifest))
            .option("mode", mode)
        )
        if failure is not None:
            writer = writer.option("failure", json.dumps(list(failure)))
        if chunk_rows is not None:
            writer = writer.option("chunkRows", str(chunk_rows))
        if hold_novel:
            writer = writer.option("holdNovel", "true")
        if only is not None:
            writer = writer.option("only", json.dumps(only.to_json()))
        try:
            writer.save()
        except BaseException:
            # tasks that Spark cancelled when the job failed leave their chunks behind (their
            # worker is killed, not asked): this writer's staging holds nothing else now
            if mode == WRITE:
                with contextlib.suppress(Exception):
                    destination_for(config_json, dest.id).clean_staging(dest.id)
            raise
        content = json.loads(manifest.read_text())
    finally:
        manifest.unlink(missing_ok=True)
    summary = Summary()
    for s in content["summaries"]:
        summary.merge(Summary.from_json(s))
    return SinkResult([StagedPart.from_json(p) for p in content["parts"]], summary)
