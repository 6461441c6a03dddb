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

Arrow column types per ``ColumnType``: BOOL ``bool``, INT64 ``int64``, FLOAT64 ``float64``,
TIMESTAMP ``timestamp[us, tz=UTC]``, STRING ``string``.

Errors: ``TransientError`` subclasses for what a retry may fix (connection lost, lock timeout),
``TerminalError`` subclasses for the rest; each connector decides in one function
(``classify(exc)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self

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


ARCHIVE_EVENT = "event"  # an archive's rows: the event's JSON text ...
ARCHIVE_TIMESTAMP = "_timestamp"  # ... and its receive time (see Destination.archives_events)


class DestinationError(TerminalError):
    code = "HW-DST-001"


class DestinationUnavailable(TransientError):
    code = "HW-DST-002"


class Destination(ABC):
    """One configured destination (a DuckDB file, a PostgreSQL database, a folder of files)."""

    kind: ClassVar[str]
    dialect: Dialect
    # True for archives: each table's rows are the events themselves, two columns (``event``:
    # the event's JSON text after context enrichment, ``_timestamp``: its receive time), not
    # flattened and typed columns; ``table`` and ``ensure_table`` are then not called
    archives_events: bool = False

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

    @abstractmethod
    def committed(self, writer_id: str) -> int | None:
        """The highest batch id recorded for ``writer_id``, or None."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
