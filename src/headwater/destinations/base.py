"""The destination contract: what the pipeline asks of every warehouse and file writer.

The pipeline hands a destination, per micro-batch, one Arrow table per target table, already
flattened, named and typed (``headwater.destinations.types.ColumnType`` per column, carried in
``TableSchema``). The destination:

1. ``table(name)`` reads a table's structure (``None`` when it does not exist);
2. ``ensure_table(schema)`` creates the table or adds the missing columns (``ALTER TABLE``),
   under a lock per destination/table, keeping the primary key; columns the table has and the
   batch lacks are left alone. It returns the structure after patching;
3. ``write_batch(writer_id, batch_id, tables)`` writes every table's rows and records
   ``(writer_id, batch_id)`` in its ledger **atomically** (one transaction, or the destination's
   own idempotent insert), so that a replay of the same batch writes nothing twice. It returns
   ``False`` when the ledger already holds the batch (nothing written). With a primary key, rows
   replace the rows with the same key (upsert), the last one in the batch winning. When an insert
   fails because the table changed underneath (a column dropped or added by someone else), the
   destination refreshes its structure, patches and retries once.

Executors write, the driver commits, so that no event row travels through the driver (one process
would bottleneck every batch) and a batch's rows land with its ledger row or not at all. A Spark
task calls ``stage(...)`` with its share of a micro-batch's rows, which puts them where the driver
can take them from (Parquet files next to the database, an UNLOGGED staging table) and returns
``StagedPart``s, small enough to travel back in a commit message; the driver then calls
``commit_staged(...)``, which moves every listed part into its table and records the batch in the
ledger in one atomic step. Staging never touches a target table or the ledger, and only the parts
listed are committed, so a failed or speculative task attempt's staging is never visible:
``discard_staged`` removes what an aborted job staged, ``clean_staging`` what a crashed run left.
Staged rows carry ``_hw_order`` (``ORDER_COLUMN``), the rows' order in the batch: with a primary
key the highest wins; it is not a column of the target table.

Arrow column types per ``ColumnType``: BOOL ``bool``, INT64 ``int64``, FLOAT64 ``float64``,
TIMESTAMP ``timestamp[us, tz=UTC]``, STRING ``string``.

Errors: ``TransientError`` subclasses for what a retry may fix (connection lost, lock timeout),
``TerminalError`` subclasses for the rest; each connector decides in one function
(``classify(exc)``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from headwater.bus.base import Closing
from headwater.destinations.types import ColumnType
from headwater.errors import TerminalError, TransientError

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.destinations.dialect import Dialect


@dataclass(frozen=True)
class Column:
    name: str  # already normalised for the dialect
    type: ColumnType
    sql_type: str | None = None  # an explicit SQL type (mapping ``cast``), else the dialect's


@dataclass(frozen=True)
class TableSchema:
    name: str
    columns: dict[str, Column] = field(default_factory=dict)
    primary_key: tuple[str, ...] = ()

    def missing_from(self, existing: TableSchema | None) -> list[Column]:
        """The columns of ``self`` that ``existing`` lacks (all of them when it is None)."""
        have = existing.columns if existing is not None else {}
        return [c for name, c in self.columns.items() if name not in have]


@dataclass(frozen=True)
class StagedPart:
    """One staged piece of a batch's rows, as a task reports it to the driver."""

    table: str  # the target table
    rows: int
    ref: str  # where the rows wait: a file path, a staging table's name
    task: str  # the task attempt that staged it (for logs)
    meta: Mapping[str, Any] = field(default_factory=dict)  # what else the commit needs (delta)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StagedPart:
        return cls(
            str(data["table"]),
            int(data["rows"]),
            str(data["ref"]),
            str(data["task"]),
            dict(data.get("meta") or {}),
        )


ORDER_COLUMN = "_hw_order"  # staged rows' order within the batch (see the module docstring)

ARCHIVE_EVENT = "event"  # an archive's rows: the event's JSON text ...
ARCHIVE_TIMESTAMP = "_timestamp"  # ... and its receive time (see Destination.archives_events)
SESSION_COLUMN = "_hw_session"  # a row's session key, when the source frame carries one
RECORD_COLUMNS = ("key", "value", "headers", "topic", "partition", "offset")  # the record's own


class DestinationError(TerminalError):
    code = "HW-DST-001"


class DestinationUnavailable(TransientError):
    code = "HW-DST-002"


class Destination(Closing):
    """One configured destination (a DuckDB file, a PostgreSQL database, a folder of files)."""

    kind: ClassVar[str]
    dialect: Dialect
    # True for archives: each table's rows are the events themselves, two columns (``event``:
    # the event's JSON text after context enrichment, ``_timestamp``: its receive time), not
    # flattened and typed columns; ``table`` and ``ensure_table`` are then not called
    archives_events: bool = False
    # True for destinations that send each task's rows on (``http``): the archive's rows also
    # carry ``SESSION_COLUMN`` and the source record (``RECORD_COLUMNS``, for the failed store),
    # and a task ends with ``finish_stage``
    delivers: bool = False
    # JSON paths whose values make a row's session: the writer puts each session in one task
    session_paths: tuple[str, ...] = ()

    @abstractmethod
    def table(self, name: str) -> TableSchema | None:
        """The table's structure as the destination has it now, or None."""

    @abstractmethod
    def ensure_table(self, schema: TableSchema) -> TableSchema:
        """Create ``schema.name`` or add its missing columns; return the structure after."""

    @abstractmethod
    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        """Write every table's rows and record the batch, atomically; False when the batch
        was already recorded (nothing written)."""

    def stage(
        self, writer_id: str, batch_id: int, task: str, tables: Mapping[str, pa.Table]
    ) -> list[StagedPart]:
        """In a Spark task (another process, maybe another machine: nothing of the driver's
        state is needed): put every table's rows (with ``ORDER_COLUMN``) in staging, under
        names no other call uses, and say where. Never touches a target table or the ledger."""
        raise NotImplementedError(f"{self.kind} destinations cannot stage rows in tasks")

    def finish_stage(
        self,
        writer_id: str,
        batch_id: int,
        task: str,
        on_failed: Callable[[list[tuple[dict[str, Any], str, str]]], None],
        *,
        abandon: bool = False,
    ) -> list[StagedPart]:
        """In a Spark task, after its last ``stage``: for a destination that ``delivers``, wait
        until every row it was given is delivered or given up (``on_failed`` gets those as
        ``(record, code, reason)``) and say what was sent; ``abandon``: the task failed, stop
        sending. Nothing to do for the others."""
        return []

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        """On the driver, in one atomic step: when the ledger already holds the batch, write
        nothing and return False; else move every part's rows into its table (upserting on
        ``schemas[table].primary_key``, the highest ``ORDER_COLUMN`` winning) and record the
        batch. The parts' staging is removed either way."""
        raise NotImplementedError(f"{self.kind} destinations cannot commit staged rows")

    def discard_staged(self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]) -> None:
        """Remove the staging of parts that will not be committed (an aborted job)."""
        raise NotImplementedError(f"{self.kind} destinations cannot stage rows in tasks")

    def clean_staging(self, writer_id: str) -> None:
        """Remove whatever staging of ``writer_id`` is left: by a crashed run (a writer starting),
        or by task attempts that died with their executor (after a commit)."""
        raise NotImplementedError(f"{self.kind} destinations cannot stage rows in tasks")

    @abstractmethod
    def committed(self, writer_id: str) -> int | None:
        """The highest batch id recorded for ``writer_id``, or None."""
