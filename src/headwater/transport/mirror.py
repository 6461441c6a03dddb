"""A destination with ``apply: upsert``: each micro-batch of transport messages applied to the
destination's tables so that each mirrors its source table.

Per micro-batch (the ``foreachBatch`` function of the destination's query):

1. a batch the destination's ledger holds already is skipped (a replay after a crash);
2. in the executors (one Spark job), each task reads its records, keeps the namespaces the
   destination takes (``namespace``), runs the destination's ``functions`` on each message
   (one dropped is simply not staged: the batch's offsets still move past it), stages the
   changes (``headwater.transport.apply.CHANGES``) and returns where, with the schema messages
   it saw: no row passes through the driver;
3. the driver learns the namespaces' columns from the schema messages (kept in
   ``<checkpoints>/<destination>.mirror.json``), creates or widens each table, and applies the
   staged changes with the batch's ledger row in one transaction;
4. when that fails as terminal: with ``on_error: isolate`` (the default) the changes are applied
   again in order, in halves, and halves of halves, until each bad change is alone: those go to
   the failed store, the rest is applied, and the batch is recorded; with ``on_error: stop``
   the destination stops at its last committed batch (the error is in its status).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa

from headwater.config.model import HeadwaterConfig
from headwater.destinations.base import StagedPart
from headwater.errors import TerminalError, TransientError
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.writer import WriterBase
from headwater.transport.apply import (
    CHANGES,
    CHANGES_TABLE,
    MirrorDestination,
    MirrorTable,
    mirror_of,
)
from headwater.transport.message import HEADER_NAMESPACE

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


log = logging.getLogger(__name__)
BAD_MESSAGE = "HW-TRN-003"  # a record that is not a transport message
NO_SCHEMA = "HW-TRN-004"  # changes of a namespace whose columns were never announced
APPLY_STEP = "apply"
_OUT = "kind string, body string"
_LSN = re.compile(r"[0-9A-F]{1,8}/[0-9A-F]{1,8}")


class MirrorStopped(TerminalError):
    """``on_error: stop``: a batch failed; the destination stays at its last batch."""

    code = "HW-TRN-005"


class NoSchema(TerminalError):
    code = NO_SCHEMA


@dataclass
class MirrorStats:
    batch_id: int
    changes: int = 0
    failed: int = 0
    tables: list[str] = field(default_factory=list)
    replayed_batch: bool = False
    seconds: float = 0.0


class Schemas:
    """The namespaces' columns as the schema messages announced them, kept in a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._changed = False
        try:
            self.columns: dict[str, list[dict[str, Any]]] = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            self.columns = {}

    def learn(self, namespace: str, columns: list[dict[str, Any]]) -> None:
        """The latest announcement wins; a column it lacks (dropped at the source) stays in
        the mirror, so it is kept at the end."""
        known = self.columns.get(namespace, [])
        names = {c["name"] for c in columns}
        learned = [*columns, *(c for c in known if c["name"] not in names)]
        if learned != known:
            self.columns[namespace] = learned
            self._changed = True

    def save(self) -> None:
        """Write the file when something new was learned since the last save."""
        from headwater.transport.reader import write_json

        if self._changed:
            write_json(self.path, self.columns)
            self._changed = False


class MirrorWriter(WriterBase[MirrorDestination, MirrorStats]):
    def __init__(self, config: HeadwaterConfig, dest: DestinationConfig) -> None:
        super().__init__(config, dest)
        self.schemas = Schemas(config.checkpoint_dir() / f"{dest.id}.mirror.json")

    def _open(self) -> MirrorDestination:
        from headwater.destinations import open_destination

        return mirror_of(open_destination(self.dest, self.config.data_dir))

    def _new_stats(self, batch_id: int) -> MirrorStats:
        return MirrorStats(batch_id)

    def _write(self, df: DataFrame, stats: MirrorStats, started: float) -> None:
        from headwater.pipeline import sink

        batch_id = stats.batch_id
        destination = self.destination
        frame, ranges = sink.task_frame(df)
        marks = destination.writer_offsets(self.dest.id)
        if ranges != [] and self.dest.functions:
            frame = self._functions(frame, marks)
        parts: list[StagedPart] = []
        present: dict[str, int] = {}
        bad: list[dict[str, Any]] = []
        ends: dict[tuple[str, int], int] = {}
        if ranges:  # the batch's end, records dropped by functions included
            main = (r for r in ranges if r["bus"] == sink.MAIN_BUS)
            ends = {(r["topic"], r["partition"]): r["end"] for r in main}
        if ranges != []:
            stage = partial(
                _stage_task,
                self.config.model_dump_json(),
                self.dest.id,
                batch_id,
                self.dest,
                _marks_json(marks),
            )
            for row in frame.mapInArrow(stage, _OUT).collect():
                body = orjson.loads(row.body)
                if row.kind == "end":
                    tp = (body["topic"], body["part"])
                    ends[tp] = max(ends.get(tp, 0), body["next"])
                elif row.kind == "part":
                    parts.append(StagedPart.from_json(body))
                elif row.kind == "schema":
                    self.schemas.learn(body["namespace"], body["columns"])
                elif row.kind == "count":
                    present[body["namespace"]] = present.get(body["namespace"], 0) + body["n"]
                else:
                    bad.append(body)
        try:
            self.schemas.save()
            tables = [self.table(ns) for ns in sorted(present)]
            for t in tables:
                destination.ensure_mirror(t)
            failed = self._apply(batch_id, parts, tables, ends)
        except BaseException:
            destination.discard_staged(self.dest.id, batch_id, parts)
            raise
        self._fail(bad + failed)
        stats.changes = sum(present.values())
        stats.failed = len(bad) + len(failed)
        stats.tables = [t.name for t in tables]
        stats.seconds = time.monotonic() - started
        self._done(stats)

    def _functions(self, frame: DataFrame, marks: dict[tuple[str, int], int]) -> DataFrame:
        """The destination's namespace filter and functions over the batch's records (read by
        the tasks when the frame is ranges of records), those below the writer's own offsets
        left out first."""
        from pyspark.sql import functions as F

        from headwater.bus.layout import SCHEMA_DDL
        from headwater.transport.functions import apply_to_frame

        if "start" in frame.columns:
            frame = frame.mapInArrow(partial(_records, self.config.model_dump_json()), SCHEMA_DDL)
        for (topic, part), next_offset in marks.items():
            below = (
                (F.col("topic") == topic)
                & (F.col("partition") == part)
                & (F.col("offset") < next_offset)
            )
            frame = frame.filter(~below)
        return apply_to_frame(frame, self.dest.namespace, self.dest.functions)

    def table(self, namespace: str) -> MirrorTable:
        columns = self.schemas.columns.get(namespace)
        if not columns:
            raise NoSchema(
                f"changes of {namespace} came before any schema message: the destination "
                "cannot type them (was the topic read from its start?)"
            )
        database, _, rest = namespace.partition(".")
        schema, _, table = rest.partition(".")
        name = self.dest.mirror_table.format(database=database, schema=schema, table=table)
        return MirrorTable.from_schema(namespace, name, columns)

    def _apply(
        self,
        batch_id: int,
        parts: list[StagedPart],
        tables: list[MirrorTable],
        ends: dict[tuple[str, int], int],
    ) -> list[dict[str, Any]]:
        """Apply the batch and move the writer's offsets to its ``ends``; the changes that
        failed alone (isolate mode), as failed rows."""
        destination = self.destination
        try:
            destination.apply_changes(self.dest.id, batch_id, parts, tables, ends)
            return []
        except TransientError:
            raise
        except Exception as exc:
            if self.dest.on_error == "stop":
                raise MirrorStopped(
                    f"destination {self.dest.id} stopped at batch {batch_id}: {exc} "
                    "(on_error: stop; see `headwater pipeline step`)"
                ) from exc
            log.warning(
                "destination %s batch %d failed (%s): applying it change by change",
                self.dest.id,
                batch_id,
                exc,
            )
        return destination.apply_isolated(self.dest.id, batch_id, parts, tables, ends)

    def _fail(self, rows: list[dict[str, Any]]) -> None:
        """Send failed changes to the failed store, with their original records."""
        if not rows:
            return
        from headwater.pipeline.failed import FailedEvent, FailedStore, make_id, now_iso

        bus_config = self.config
        from headwater.bus import open_bus

        events = []
        with open_bus(bus_config, read_only=True) as bus:
            for r in rows:
                got = bus.read(r["topic"], r["part"], r["offset"], max_records=1)
                record = got[0] if got and got[0].offset == r["offset"] else None
                events.append(
                    FailedEvent(
                        id=make_id(self.dest.id, r["topic"], r["part"], r["offset"]),
                        destination=self.dest.id,
                        step=APPLY_STEP,
                        code=r["code"],
                        reason=r["reason"][:2000],
                        topic=r["topic"],
                        partition=r["part"],
                        offset=r["offset"],
                        failed_at=now_iso(),
                        key=record.key if record else None,
                        value=record.value if record else b"",
                        headers=record.headers if record else (),
                    )
                )
        FailedStore(self.config).append(events)

    def _done(self, stats: MirrorStats) -> None:
        self.last = stats
        self.batches += 1
        self.written += stats.changes - stats.failed
        self.failed_events += stats.failed
        log.info(
            "destination %s batch %d: %d changes applied to %s, %d failed (%.2f s)",
            self.dest.id,
            stats.batch_id,
            stats.changes - stats.failed,
            stats.tables,
            stats.failed,
            stats.seconds,
        )


def _stage_task(
    config_json: str,
    destination_id: str,
    batch_id: int,
    dest: DestinationConfig,
    marks_json: str,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """In a Spark task: stage this task's changes; yield where, the schema messages, the
    changes per namespace, the records that are not transport messages, and the next offset
    of each partition it read. Records below the writer's own offsets are done: skipped."""
    from headwater.pipeline.sink import destination_for, records, task_name

    taken = re.compile(dest.namespace)
    marks = {(t, p): o for t, p, o in orjson.loads(marks_json)}
    ends: dict[tuple[str, int], int] = {}
    columns: dict[str, list[Any]] = {name: [] for name in CHANGES.names}
    out: list[tuple[str, dict[str, Any]]] = []
    counts: dict[str, int] = {}
    for rb in records(batches, config_json):
        for r in rb.to_pylist():
            tp = (r["topic"], r["partition"])
            ends[tp] = max(ends.get(tp, 0), r["offset"] + 1)
            if r["offset"] < marks.get(tp, 0):
                continue
            headers = dict(r["headers"] or ())
            namespace = headers.get(HEADER_NAMESPACE)
            if namespace is not None and not taken.fullmatch(namespace.decode()):
                continue
            where = {"topic": r["topic"], "part": r["partition"], "offset": r["offset"]}
            try:
                message = orjson.loads(r["value"])
                if not isinstance(message, dict) or "op" not in message:
                    raise ValueError("not a transport message (no op)")
                if namespace is None and not taken.fullmatch(str(message.get("namespace"))):
                    continue
            except Exception as exc:
                out.append(("bad", {**where, "code": BAD_MESSAGE, "reason": str(exc)}))
                continue
            op = message["op"]
            if op == "schema":
                out.append(("schema", {"namespace": message["namespace"], **message}))
                continue
            if op == "complete":
                continue
            ns = message["namespace"]
            counts[ns] = counts.get(ns, 0) + 1
            add_change(columns, message, r["topic"], r["partition"], r["offset"])
    if columns["op"]:
        table = pa.table(columns, schema=CHANGES)
        destination = destination_for(config_json, destination_id)
        for part in destination.stage(
            destination_id, batch_id, task_name(), {CHANGES_TABLE: table}
        ):
            out.append(("part", part.to_json()))
    out += [("count", {"namespace": ns, "n": n}) for ns, n in counts.items()]
    out += [("end", {"topic": t, "part": p, "next": n}) for (t, p), n in ends.items()]
    if out:
        yield pa.RecordBatch.from_pydict(
            {
                "kind": [k for k, _ in out],
                "body": [orjson.dumps(b).decode() for _, b in out],
            }
        )


def _records(config_json: str, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """In a Spark task: the records of its ranges."""
    from headwater.pipeline.sink import records

    yield from records(batches, config_json)


def add_change(
    columns: dict[str, list[Any]], message: dict[str, Any], topic: str, part: int, offset: int
) -> None:
    """Add a change message to the columns of ``CHANGES`` being built."""
    key, data, unchanged = message.get("key"), message.get("data"), message.get("unchanged")
    columns["namespace"].append(message["namespace"])
    columns["op"].append(message["op"])
    columns["key"].append(
        None if key is None else orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode()
    )
    columns["data"].append(None if data is None else orjson.dumps(data).decode())
    columns["unchanged"].append(orjson.dumps(unchanged).decode() if unchanged else None)
    columns["topic"].append(topic)
    columns["part"].append(part)
    columns["_hw_order"].append(offset)
    columns["lsn"].append(lsn_of(message.get("position")))


def lsn_of(position: Any) -> int | None:
    """A PostgreSQL position (``16/B374D848``) as a number; None for the others."""
    if isinstance(position, str) and _LSN.fullmatch(position):
        high, _, low = position.partition("/")
        return (int(high, 16) << 32) | int(low, 16)
    return None


def _marks_json(marks: dict[tuple[str, int], int]) -> str:
    return orjson.dumps([[t, p, o] for (t, p), o in marks.items()]).decode()
