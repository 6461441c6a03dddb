"""A SQL warehouse's connection as the SQL destinations use it (``Session``: one connection, one
transaction at a time, its catalog queries, lock and bulk load), and the error a load raises when
the table changed underneath it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from headwater.errors import TransientError

if TYPE_CHECKING:
    import pyarrow as pa


class TableChanged(TransientError):
    """A load failed because the table's columns are not what the batch was planned against.

    The destination patches and retries once itself; when the table changes again in between,
    this leaves it as transient: the next attempt of the batch patches again."""

    code = "HW-DST-003"


class Session(ABC):
    """One connection of a warehouse, used by one thread at a time."""

    placeholder: ClassVar[str] = "?"  # how the driver marks a query parameter

    @abstractmethod
    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    @abstractmethod
    def begin(self) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def rollback(self) -> None: ...

    @abstractmethod
    def columns(self, table: str) -> list[tuple[str, str]]:
        """(name, SQL type) of every column, in order; empty when the table does not exist."""

    @abstractmethod
    def primary_key(self, table: str) -> tuple[str, ...]: ...

    @abstractmethod
    def lock(self, table: str) -> None:
        """Hold a lock on patching ``table`` until the transaction ends."""

    @abstractmethod
    def load(self, table: str, rows: pa.Table, primary_key: tuple[str, ...]) -> None:
        """Insert ``rows`` (upsert on ``primary_key`` when given); raise TableChanged when a
        column is missing or the table is gone."""

    @abstractmethod
    def record_batch(self, writer_id: str, batch_id: int) -> bool:
        """Insert the ledger row; False when it is already there."""

    @abstractmethod
    def close(self) -> None: ...

    def is_open(self) -> bool:
        """Whether the connection can still be used (a driver may notice it was lost)."""
        return True
