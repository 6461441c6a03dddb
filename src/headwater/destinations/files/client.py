"""Files (``path``, default ``<data_dir>/files/<id>``): Parquet per table, or the seed's
archive, JSON lines gzip'd per day (``format: jsonl.gz``).

Layout: ``<table>/<writer>-<batch>.parquet`` (flattened, typed rows), or
``<table>/<YYYY-MM-DD>/<writer>-<batch>.jsonl.gz``: the archive holds each event as it was
after context enrichment, one JSON object per line, not flattened (seed 002's
``events/archive``), in the folder of the UTC day of its ``_timestamp`` (else the day it is
written). Every file is written
under a temporary name and renamed into place, and the ledger (``_headwater_batches/<writer>``,
the last batch written) is replaced after the batch's files: a replay after a crash writes the
same names again, so nothing appears twice. Files only append: a primary key is refused.

Spark tasks stage files in ``<path>.staging/<writer>/<batch>/<table>/`` (the same layout below
the table); the driver's commit is a rename of each into place (``<writer>-<batch>-<part>``),
made atomic by an intent file: it writes ``_headwater_batches/<writer>.commit`` (the batch and
every rename) first, then renames, replaces the ledger, and deletes the intent. After a crash
anywhere in between, the intent is rolled forward (the next commit, ``clean_staging``), so a
batch's files are there either all or not at all once the ledger is read.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from headwater.destinations.base import (
    ARCHIVE_EVENT,
    ARCHIVE_TIMESTAMP,
    Column,
    Destination,
    DestinationError,
    DestinationUnavailable,
    StagedPart,
    TableSchema,
)
from headwater.destinations.batches import (
    part_name,
    remove_files,
    remove_writer_staging,
    replace_file,
    stage_parquet,
    staged_paths,
    staging_beside,
    utc_timestamps,
    without_order,
    writer_folder,
)
from headwater.destinations.dialect import Dialect
from headwater.destinations.duckdb.dialect import DuckDBDialect
from headwater.destinations.types import ColumnType
from headwater.errors import HeadwaterError, classified_by

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.pipeline.config import DestinationConfig

LEDGER = "_headwater_batches"
SCHEMA_FILE = "_schema.json"
# a full disk or quota, a busy or interrupted file system: an operator or time may fix these
_TRANSIENT_ERRNO = {errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EBUSY, errno.EINTR}


def classify(exc: BaseException) -> HeadwaterError:
    """A file-system error as headwater's: space and busy errors transient, the rest terminal."""
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return DestinationUnavailable(f"files: {exc}")
    return DestinationError(f"files: {exc}")


def _classified() -> AbstractContextManager[None]:
    return classified_by(classify)


class FilesDestination(Destination):
    kind = "files"

    def __init__(self, root: Path, fmt: str, dialect: Dialect | None = None) -> None:
        self.root = root
        self.format = fmt
        self.dialect = dialect or DuckDBDialect()  # names as a later DuckDB/Spark read wants
        root.mkdir(parents=True, exist_ok=True)

    @property  # type: ignore[override]
    def archives_events(self) -> bool:
        return self.format == "jsonl.gz"

    def table(self, name: str) -> TableSchema | None:
        path = self.root / name / SCHEMA_FILE
        if not path.exists():
            return None
        cols = json.loads(path.read_text())
        return TableSchema(name, {n: Column(n, ColumnType(t)) for n, t in cols.items()})

    def ensure_table(self, schema: TableSchema) -> TableSchema:
        if schema.primary_key:
            raise DestinationError(
                f"files destinations only append: table {schema.name!r} cannot have a "
                f"primary key ({', '.join(schema.primary_key)})"
            )
        have = self.table(schema.name)
        cols = {n: c.type.value for n, c in (have.columns if have else {}).items()}
        for c in schema.missing_from(have):
            cols[c.name] = c.type.value
        with _classified():
            replace_file(self.root / schema.name / SCHEMA_FILE, json.dumps(cols).encode())
        after = self.table(schema.name)
        assert after is not None
        return after

    def committed(self, writer_id: str) -> int | None:
        path = self.root / LEDGER / writer_id
        return int(path.read_text()) if path.exists() else None

    def write_batch(self, writer_id: str, batch_id: int, tables: Mapping[str, pa.Table]) -> bool:
        with _classified():
            self._recover(writer_id)
        done = self.committed(writer_id)
        if done is not None and batch_id <= done:
            return False
        stem = f"{writer_id}-{batch_id:012d}"
        with _classified():
            for name, rows in tables.items():
                rows = utc_timestamps(rows)
                if self.format == "parquet":
                    self._parquet(self.root / name / f"{stem}.parquet", rows)
                else:
                    self._jsonl(self.root / name, stem, rows)
            replace_file(self.root / LEDGER / writer_id, str(batch_id).encode())
        return True

    @staticmethod
    def _parquet(path: Path, rows: pa.Table) -> None:
        tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)

    @property
    def staging(self) -> Path:
        return staging_beside(self.root)

    def stage(
        self, writer_id: str, batch_id: int, task: str, tables: Mapping[str, pa.Table]
    ) -> list[StagedPart]:
        with _classified():
            if self.format == "parquet":
                return stage_parquet(
                    self.staging, writer_id, batch_id, task, tables, keep_order=False
                )
            parts = []
            for name, rows in tables.items():
                if not rows.num_rows:
                    continue
                folder = writer_folder(self.staging, writer_id) / str(batch_id) / name
                for path, count in self._jsonl(folder, part_name(task), without_order(rows)):
                    parts.append(StagedPart(name, count, str(path), task))
            return parts

    def commit_staged(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        schemas: Mapping[str, TableSchema],
    ) -> bool:
        with _classified():
            self._recover(writer_id)
            done = self.committed(writer_id)
            if done is not None and batch_id <= done:
                remove_files(parts)
                return False
            staged_paths(parts)  # all still there
            batch = writer_folder(self.staging, writer_id) / str(batch_id)
            moves = []
            for part in parts:
                rel = Path(part.ref).relative_to(batch)
                final = self.root / rel.parent / f"{writer_id}-{batch_id:012d}-{rel.name}"
                moves.append((part.ref, str(final)))
            intent = {"batch_id": batch_id, "moves": moves}
            replace_file(self._intent(writer_id), json.dumps(intent).encode())
            self._recover(writer_id)
            remove_files(parts)  # the folders they leave empty
        return True

    def _intent(self, writer_id: str) -> Path:
        return self.root / LEDGER / f"{writer_id}.commit"

    def _recover(self, writer_id: str) -> None:
        """Carry out a commit's intent, if one is there: its renames (those not done yet,
        each file made durable first), then the ledger; then forget it."""
        path = self._intent(writer_id)
        if not path.exists():
            return
        intent = json.loads(path.read_text())
        done = self.committed(writer_id)
        if done is None or intent["batch_id"] > done:
            for src, dst in intent["moves"]:
                if os.path.exists(src):
                    with open(src, "rb") as f:
                        os.fsync(f.fileno())
                    Path(dst).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(src, dst)
            replace_file(self.root / LEDGER / writer_id, str(intent["batch_id"]).encode())
        path.unlink()

    def discard_staged(self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]) -> None:
        with _classified():
            remove_files(parts)

    def clean_staging(self, writer_id: str) -> None:
        with _classified():
            self._recover(writer_id)  # an interrupted commit's files are the batch's
            remove_writer_staging(self.staging, writer_id)

    @staticmethod
    def _jsonl(folder: Path, stem: str, rows: pa.Table) -> list[tuple[Path, int]]:
        """``rows``: ``event`` (JSON text) and ``_timestamp``, as ``archives_events`` says."""
        missing = {ARCHIVE_EVENT, ARCHIVE_TIMESTAMP} - set(rows.column_names)
        if missing:
            raise DestinationError(
                f"files: a jsonl.gz archive takes the events' JSON ({ARCHIVE_EVENT}) and their "
                f"{ARCHIVE_TIMESTAMP}; the rows lack {', '.join(sorted(missing))}"
            )
        today = datetime.now(UTC).date().isoformat()
        days: dict[str, list[bytes]] = {}
        events = rows.column(ARCHIVE_EVENT).to_pylist()
        times = rows.column(ARCHIVE_TIMESTAMP).to_pylist()
        for text, at in zip(events, times, strict=True):
            day = at.astimezone(UTC).date().isoformat() if isinstance(at, datetime) else today
            days.setdefault(day, []).append(text.encode())
        written = []
        for day, lines in days.items():
            data = gzip.compress(b"\n".join(lines) + b"\n", mtime=0)
            replace_file(folder / day / f"{stem}.jsonl.gz", data)
            written.append((folder / day / f"{stem}.jsonl.gz", len(lines)))
        return written

    def close(self) -> None:
        """Nothing stays open."""


def open_destination(config: DestinationConfig, data_dir: Path) -> FilesDestination:
    if config.primary_key:
        raise DestinationError(f"destination {config.id!r}: files only append; remove primary_key")
    root = Path(config.path) if config.path else data_dir / "files" / config.id
    return FilesDestination(root, config.format)
