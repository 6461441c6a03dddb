"""The sink's Spark job: executors run a micro-batch's program over their rows and stage the
result into the destination; the driver gets back what they staged and what they learned, to
commit with its ledger.

No event row travels through the driver: it would make one process the bottleneck of every batch
and hold a whole batch in its memory. Inside ``foreachBatch`` the writer runs the batch's source
frame (the log's records, untouched, or ranges of them) through ``mapInArrow`` with
:meth:`SinkWriter.task`: each Spark task (``write``) runs the batch's ``Program``
(``headwater.pipeline.task``: the steps as one DuckDB query per task), stages each table's rows in
chunks (``Destination.stage``, in the task's own Python worker), appends the rows a step failed to
the failed store, and returns the parts and a ``Summary`` as one row of JSON, its commit message.
:func:`run` collects one message per task (Spark keeps one successful attempt of each) and returns
them to the caller, which commits them (``Destination.commit_staged``); nothing staged is visible
before that.

This is the commit protocol of PySpark's Python data source writer (``write`` in the tasks, the
messages to the driver) without that writer's planning processes: Spark runs a data source
writer's ``writer()`` and ``commit()`` in Python processes of their own, a daemon and an idle
worker each (~235 MB together), which were an eighth of the pipeline's memory
(``docs/benchmarks.md``). A failing task discards what it staged before it fails; when the job
fails, tasks Spark cancelled (their worker is killed, not asked) and finished ones may have left
parts, so :func:`run` cleans the writer's staging (the writer also calls ``clean_staging`` when
it starts).

``SinkOptions``: the configuration (``HeadwaterConfig`` as JSON), the destination (its id, also
the ledger's writer id), the batch id, the ``Program``, the ``mode`` (``program.MODES``), for
``fail_all`` the ``failure`` (``[step, code, reason]``), the rows per query output and staged
part, and for destinations that deliver, ``hold_novel`` and ``only`` (see ``TaskRun``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headwater.pipeline.positions import Positions
from headwater.pipeline.program import CHUNK_ROWS, WRITE, Program, check_mode

if TYPE_CHECKING:  # the rest is imported where it is used (the driver and the tasks need
    # different parts of it)
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from headwater.config.model import HeadwaterConfig
    from headwater.delivery.frame import Buckets
    from headwater.destinations import Destination
    from headwater.destinations.base import StagedPart
    from headwater.pipeline.config import DestinationConfig
    from headwater.pipeline.failed import FailedEvent, FailedStore
    from headwater.pipeline.task import Summary

log = logging.getLogger(__name__)

MESSAGE = "message"  # the column of a task's commit message (JSON)
MAIN_BUS, FAILED_BUS = "main", "failed"  # the buses ranges of records are on
BUCKET, BUCKETS = "bucket", "buckets"  # a range row's bucket (see headwater.delivery.frame)

_destinations: dict[tuple[str, str], Destination] = {}
_destinations_lock = threading.Lock()


def destination_for(config_json: str, destination_id: str) -> Destination:
    """This process's instance of a configured destination (opened on first use; a Python
    worker runs many tasks)."""
    from headwater.config.model import HeadwaterConfig
    from headwater.destinations import open_destination

    key = (config_json, destination_id)
    with _destinations_lock:
        dest = _destinations.get(key)
        if dest is None:
            config = HeadwaterConfig.from_trusted_json(config_json)
            dest = open_destination(destination_config(config, destination_id), config.data_dir)
            _destinations[key] = dest
        return dest


def destination_config(config: HeadwaterConfig, destination_id: str) -> DestinationConfig:
    for dest in config.pipeline.destinations:
        if dest.id == destination_id:
            return dest
    raise KeyError(f"no destination {destination_id!r} in the configuration")


@dataclass
class StagedMessage:
    """A task's commit message: the parts it staged and its summary, as JSON objects."""

    parts: list[dict[str, Any]]
    summary: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"parts": self.parts, "summary": self.summary})

    @classmethod
    def from_json(cls, text: str) -> StagedMessage:
        data = json.loads(text)
        return cls(data["parts"], data["summary"])


@dataclass(frozen=True)
class SinkOptions:
    config_json: str
    destination: str
    batch_id: int
    program: Program
    mode: str = WRITE
    failure: tuple[str, str, str] | None = None
    chunk_rows: int = CHUNK_ROWS
    hold_novel: bool = False
    only: Positions | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)  # on the driver, before any task runs


class SinkWriter:
    """What each task of the sink's job runs (pickled to the executors with its options)."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def task(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``mapInArrow``'s function: the task's rows in, its commit message out (one row)."""
        import pyarrow as pa

        message = self.write(batches)
        yield pa.record_batch([pa.array([message.to_json()], pa.string())], names=[MESSAGE])

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
                store.append(FailedStore(HeadwaterConfig.from_trusted_json(opts.config_json)))
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
        import headwater.pipeline.source.offsets as off
        from headwater.pipeline.failed import failed_config
        from headwater.pipeline.source.reader import LogRange, read_range

        bus = row["bus"]
        if bus not in self.configs:
            from headwater.config.model import HeadwaterConfig

            config = HeadwaterConfig.from_trusted_json(self.config_json)
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
    writer: type[SinkWriter] | None = None,
) -> SinkResult:
    """Run ``program`` over ``frame`` (the source's rows) in the executors: one Spark job.
    Returns the staged parts (``mode`` write) and the tasks' summaries merged. Raises what the
    job raised (what its tasks staged is discarded). ``writer``: the tasks' class (tests)."""
    from headwater.destinations.base import StagedPart
    from headwater.pipeline.task import Summary

    config_json = config.model_dump_json()
    options = SinkOptions(
        config_json,
        dest.id,
        batch_id,
        program,
        mode=mode,
        failure=failure,
        chunk_rows=chunk_rows or CHUNK_ROWS,
        hold_novel=hold_novel,
        only=only,
    )
    task = (writer or SinkWriter)(options).task
    try:
        rows = frame.mapInArrow(task, f"{MESSAGE} string").collect()
    except BaseException:
        # tasks that Spark cancelled when the job failed leave their chunks behind (their
        # worker is killed, not asked), and finished tasks theirs: this writer's staging holds
        # nothing else now
        if mode == WRITE:
            with contextlib.suppress(Exception):
                destination_for(config_json, dest.id).clean_staging(dest.id)
        raise
    messages = [StagedMessage.from_json(r[MESSAGE]) for r in rows]
    summary = Summary()
    for m in messages:
        summary.merge(Summary.from_json(m.summary))
    return SinkResult([StagedPart.from_json(p) for m in messages for p in m.parts], summary)


def session_frame(
    frame: DataFrame, ranges: list[dict[str, Any]] | None, group_by: list[str]
) -> DataFrame:
    """The sink's frame for ``frame`` (records, or ranges of records when ``ranges`` is not
    None) with each session in one task, in log order."""
    from headwater.delivery.frame import Buckets, session_key
    from headwater.destinations.base import SESSION_COLUMN

    tasks = frame.sparkSession.sparkContext.defaultParallelism
    if ranges is not None:
        return ranges_frame(frame.sparkSession, ranges, Buckets(tasks, group_by))
    return (
        frame.withColumn(SESSION_COLUMN, session_key(group_by))
        .repartition(tasks, SESSION_COLUMN)
        .sortWithinPartitions("topic", "partition", "offset")
    )


def warm() -> None:
    """Load what running a program needs (a worker's first task then starts at once): this
    module, the task's and the lookups'."""
    import duckdb

    from headwater.pipeline import task  # noqa: F401
    from headwater.pipeline.steps import lookup  # noqa: F401

    duckdb.connect().execute("SELECT 1").fetchall()
