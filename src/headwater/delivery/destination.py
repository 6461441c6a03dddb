"""The ``http`` pipeline destination: each Spark task delivers its share of a micro-batch
(``stage`` hands the rows to the task's ``TaskSender``, ``finish_stage`` waits for them), and
the driver's commit records the batch in the destination's ledger
(``<path>/<writer>.batch``, default ``<data_dir>/delivery/<id>``).

The rows are archive rows (``archives_events``): the event as JSON after the steps, rebuilt
nested from its fields, not flattened. Delivery is at least once: a micro-batch replayed after a
crash (its id not yet in the ledger) is sent again with the same idempotency keys, which a
receiver that dedups on ``Idempotency-Key`` drops. Sessions: with ``group_by`` the writer
partitions the batch by session key (``headwater.delivery.frame``) so that a session is in one
task; without it each task is one session, named after its partition.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from headwater.delivery.config import HttpDeliveryConfig
from headwater.delivery.metrics import METRICS, Tally
from headwater.delivery.task import OnFailed, TaskSender, given_up
from headwater.destinations.base import (
    Destination,
    DestinationError,
    StagedPart,
    TableSchema,
)
from headwater.destinations.batches import replace_file
from headwater.destinations.duckdb.dialect import DuckDBDialect

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.pipeline.config import DestinationConfig

DELIVERED = "_delivered"  # the table of a task's StagedPart: what it sent (``ref``: its counts)


class HttpDestination(Destination):
    kind = "http"
    archives_events = True
    delivers = True

    def __init__(self, settings: HttpDeliveryConfig, root: Path) -> None:
        self.settings = settings
        self.session_paths = tuple(settings.group_by)
        self.root = root
        self.dialect = DuckDBDialect()
        self._senders: dict[tuple[str, int, str], TaskSender] = {}
        self._lock = threading.Lock()

    # -- tables: an HTTP API has none -----------------------------------------------------------
    def table(self, name: str) -> TableSchema | None:
        return None

    def ensure_table(self, schema: TableSchema) -> TableSchema:
        return schema

    # -- in the tasks ---------------------------------------------------------------------------
    def stage(
        self, writer_id: str, batch_id: int, task: str, tables: Mapping[str, pa.Table]
    ) -> list[StagedPart]:
        sender = self._sender(writer_id, batch_id, task)
        for rows in tables.values():
            if rows.num_rows:
                sender.add(rows)
        return []

    def finish_stage(
        self,
        writer_id: str,
        batch_id: int,
        task: str,
        on_failed: OnFailed,
        *,
        abandon: bool = False,
    ) -> list[StagedPart]:
        with self._lock:
            sender = self._senders.pop((writer_id, batch_id, task), None)
        if sender is None:
            return []
        if abandon:
            sender.cancel()
            return []
        report = sender.finish()
        failed = given_up(report)
        for records, code, reason in failed:
            on_failed([(record, code, reason) for record in records])
        outcome, tally = report.outcome, sender.tally
        tally.requests, tally.retries = outcome.requests, outcome.retries
        tally.delivered, tally.sessions = outcome.delivered, report.sessions
        tally.failed = sum(len(records) for records, _, _ in failed)
        return [StagedPart(DELIVERED, outcome.delivered, json.dumps(tally.to_json()), task)]

    def _sender(self, writer_id: str, batch_id: int, task: str) -> TaskSender:
        key = (writer_id, batch_id, task)
        with self._lock:
            sender = self._senders.get(key)
            if sender is None:
                sender = TaskSender(self.settings, writer_id, batch_id, default_session())
                self._senders[key] = sender
            return sender

    # -- on the driver: the ledger ----------------------------------------------------------------
    def committed(self, writer_id: str) -> int | None:
        path = self._ledger(writer_id)
        return int(path.read_text()) if path.exists() else None

    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        """Records the batch (the pipeline calls it with no rows: a batch failed as a whole);
        rows are only ever delivered by the tasks."""
        if any(rows.num_rows for rows in tables.values()):
            raise DestinationError("http destinations deliver rows in the Spark tasks only")
        return self.commit_staged(writer_id, batch_id, [], {})

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        done = self.committed(writer_id)
        if done is not None and batch_id <= done:
            return False
        replace_file(self._ledger(writer_id), str(batch_id).encode())
        tallies = [Tally.from_json(json.loads(p.ref)) for p in parts if p.table == DELIVERED]
        METRICS.add(writer_id, tallies)
        return True

    def discard_staged(self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]) -> None:
        pass  # what was delivered cannot be taken back; a replay sends the same keys

    def clean_staging(self, writer_id: str) -> None:
        pass  # nothing is staged

    def _ledger(self, writer_id: str) -> Path:
        return self.root / f"{writer_id}.batch"

    def close(self) -> None:
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.cancel()


def default_session() -> str:
    """The session of a task's rows that carry no key (no ``group_by``): its partition's, so
    that a replayed micro-batch names its sessions alike."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return f"task-{ctx.partitionId()}" if ctx is not None else "task-0"


def open_destination(config: DestinationConfig, data_dir: Path) -> HttpDestination:
    if config.primary_key:
        raise DestinationError(
            f"destination {config.id!r}: an http destination sends events; remove primary_key"
        )
    settings = HttpDeliveryConfig.model_validate(config.options)
    root = Path(config.path) if config.path else data_dir / "delivery" / config.id
    return HttpDestination(settings, root)
