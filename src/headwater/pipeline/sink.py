"""The ``headwater_sink`` Spark data source: executors stage a micro-batch's rows into a
destination, and the driver gets back the list of staged parts to commit with its ledger.

Issue 8's rule is that no event row travels through the driver. Inside ``foreachBatch`` the
writer saves the batch's frame with ``format("headwater_sink")``; each Spark task (``write``)
opens the destination in its own Python worker, groups its Arrow batches by ``_hw_table`` and
calls ``Destination.stage`` every ``CHUNK_ROWS`` rows of a table (memory stays bounded whatever
the partition's size), then returns the parts as its commit message. Spark calls ``commit``
with every task's message once all succeeded, in a Python worker on the driver's machine, not
in the driver's interpreter: it writes the parts to the ``manifest`` file (atomically, by
rename), which :func:`stage_frame` reads back. ``abort`` (a task failed for good) discards the
parts the finished tasks staged; a failing task discards its own before it fails; a task Spark
cancels (its worker is killed) cannot, so :func:`stage_frame` cleans the writer's staging when
the job fails (and the writer calls ``clean_staging`` when it starts). The batch is
committed by the caller, ``Destination.commit_staged``, with the parts :func:`stage_frame`
returns: nothing staged here is visible before that.

Options: ``config`` (``HeadwaterConfig`` as JSON), ``destination`` (its id, also the ledger's
writer id), ``batch_id``, ``tables`` (JSON ``{table: [column, ...]}``), ``manifest`` (a path on
the driver's machine), and optionally ``chunkRows``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, WriterCommitMessage

from headwater.config.model import HeadwaterConfig
from headwater.destinations import Destination, open_destination
from headwater.destinations.base import ORDER_COLUMN, StagedPart
from headwater.pipeline.columns import TABLE

try:  # PySpark 4.0+ hands Arrow batches to an Arrow writer
    from pyspark.sql.datasource import DataSourceArrowWriter as _Writer
except ImportError:  # pragma: no cover - older PySpark: rows
    from pyspark.sql.datasource import DataSourceWriter as _Writer

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from headwater.pipeline.config import DestinationConfig

log = logging.getLogger(__name__)

SINK_NAME = "headwater_sink"
TABLE_COLUMN = TABLE
CHUNK_ROWS = 100_000  # rows of one table a task holds before it stages them

_destinations: dict[tuple[str, str], Destination] = {}
_destinations_lock = threading.Lock()


def register(spark: SparkSession) -> None:
    """Make ``format("headwater_sink")`` available on ``spark``."""
    spark.dataSource.register(HeadwaterSink)


def destination_for(config_json: str, destination_id: str) -> Destination:
    """This process's instance of a configured destination (opened on first use; a Python
    worker runs many tasks)."""
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
    """A task's commit message: the parts it staged, as JSON objects."""

    parts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class SinkOptions:
    config_json: str
    destination: str
    batch_id: int
    tables: dict[str, list[str | list[str]]]
    manifest: str
    chunk_rows: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        missing = [
            k
            for k in ("config", "destination", "batch_id", "tables", "manifest")
            if k not in options
        ]
        if missing:
            raise ValueError(f"{SINK_NAME}: missing option(s) {', '.join(missing)}")
        return cls(
            config_json=options["config"],
            destination=options["destination"],
            batch_id=int(options["batch_id"]),
            tables={
                str(t): [c if isinstance(c, str) else [str(x) for x in c] for c in cols]
                for t, cols in json.loads(options["tables"]).items()
            },
            manifest=options["manifest"],
            chunk_rows=int(options.get("chunkRows", CHUNK_ROWS)),
        )


class HeadwaterSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return SINK_NAME

    def writer(self, schema: StructType, overwrite: bool) -> SinkWriter:
        return SinkWriter(SinkOptions.parse(self.options))


class SinkWriter(_Writer):  # type: ignore[misc,valid-type]
    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedMessage:
        opts = self.options
        dest = destination_for(opts.config_json, opts.destination)
        task = task_name()
        buffers = TableBuffers(opts.tables)
        staged: list[StagedPart] = []
        try:
            for batch in iterator:
                buffers.add(batch)
                full = buffers.take(opts.chunk_rows)
                if full:
                    staged += dest.stage(opts.destination, opts.batch_id, task, full)
            rest = buffers.take(0)
            if rest:
                staged += dest.stage(opts.destination, opts.batch_id, task, rest)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure below is the one to report
                dest.discard_staged(opts.destination, opts.batch_id, staged)
            raise
        return StagedMessage([p.to_json() for p in staged])

    def commit(self, messages: list[StagedMessage | None]) -> None:  # type: ignore[override]
        parts = [p for m in messages if m is not None for p in m.parts]
        write_manifest(Path(self.options.manifest), parts)

    def abort(self, messages: list[StagedMessage | None]) -> None:  # type: ignore[override]
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


class TableBuffers:
    """A task's rows per target table, each table's own columns (and ``_hw_order``)."""

    def __init__(self, tables: Mapping[str, Sequence[str | Sequence[str]]]) -> None:
        # a column is its name, or [its name in the table, its name in the frame] (two tables
        # may hold columns of one name and different types: the frame names them apart)
        pairs = {t: [_pair(c) for c in cols] for t, cols in tables.items()}
        self.columns = {t: [f for _, f in p] + [ORDER_COLUMN] for t, p in pairs.items()}
        self.names = {t: [c for c, _ in p] + [ORDER_COLUMN] for t, p in pairs.items()}
        self.batches: dict[str, list[pa.RecordBatch]] = {}
        self.rows: dict[str, int] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        if not batch.num_rows:
            return
        names = batch.column(TABLE_COLUMN)
        for table in pc.unique(names).to_pylist():
            if table is None or table not in self.columns:
                raise ValueError(f"{SINK_NAME}: a row's {TABLE_COLUMN} {table!r} is no table")
            mine = batch.filter(pc.equal(names, table)) if len(self.columns) > 1 else batch
            picked = mine.select(self.columns[table]).rename_columns(self.names[table])
            self.batches.setdefault(table, []).append(picked)
            self.rows[table] = self.rows.get(table, 0) + mine.num_rows

    def take(self, at_least: int) -> dict[str, pa.Table]:
        """The tables holding ``at_least`` rows (every non-empty one for 0), removed."""
        import pyarrow as pa

        out = {}
        for table, count in list(self.rows.items()):
            if count and count >= at_least:
                out[table] = pa.Table.from_batches(self.batches.pop(table))
                del self.rows[table]
        return out


def _pair(column: str | Sequence[str]) -> tuple[str, str]:
    """(name in the table, name in the frame)."""
    if isinstance(column, str):
        return column, column
    name, frame_name = column
    return name, frame_name


def task_name() -> str:
    """``s<stage>p<partition>a<attempt>`` of the running Spark task (for logs; the staging
    names' uniqueness does not rest on it)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return f"local-{uuid.uuid4().hex[:8]}"
    return f"s{ctx.stageId()}p{ctx.partitionId()}a{ctx.attemptNumber()}"


def write_manifest(path: Path, parts: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(parts))
    os.replace(tmp, path)


def stage_frame(
    frame: DataFrame,
    config: HeadwaterConfig,
    dest: DestinationConfig,
    batch_id: int,
    tables: Mapping[str, Sequence[str | Sequence[str]]],
    *,
    chunk_rows: int | None = None,
) -> list[StagedPart]:
    """Stage ``frame``'s rows (``_hw_table``, every table's columns, ``_hw_order``) into
    ``dest`` from the executors; the parts to pass to ``commit_staged``. Raises what the Spark
    job raised (the parts of an aborted job are discarded)."""
    fd, name = tempfile.mkstemp(prefix=f"hw-sink-{dest.id}-{batch_id}-", suffix=".json")
    os.close(fd)
    manifest = Path(name)
    manifest.unlink()  # only the commit makes it
    try:
        writer = (
            frame.write.format(SINK_NAME)
            .mode("append")
            .option("config", config.model_dump_json())
            .option("destination", dest.id)
            .option("batch_id", str(batch_id))
            .option("tables", json.dumps({t: list(c) for t, c in tables.items()}))
            .option("manifest", str(manifest))
        )
        if chunk_rows is not None:
            writer = writer.option("chunkRows", str(chunk_rows))
        try:
            writer.save()
        except BaseException:
            # tasks that Spark cancelled when the job failed leave their chunks behind (their
            # worker is killed, not asked): this writer's staging holds nothing else now
            with contextlib.suppress(Exception):
                destination_for(config.model_dump_json(), dest.id).clean_staging(dest.id)
            raise
        return [StagedPart.from_json(p) for p in json.loads(manifest.read_text())]
    finally:
        manifest.unlink(missing_ok=True)
