"""The files reader: every row of the files in a directory becomes an ``insert`` on the log.

- **Namespace and position.** A file's namespace is its path relative to the directory
  (``2026/01/orders.jsonl``). A change's position is ``<path>:<byte offset after its line>``
  (Parquet: ``<path>:<rows read>``, the row's index + 1): where reading resumes after it.
- **Formats.** JSON lines: one object per line; lines appended later are read on a later poll,
  and a last line without its newline waits for it. CSV: the header row names the columns and
  values stay text; appended rows are read as for JSON lines. Parquet: a file is read once, when
  its size and time have not changed since the previous poll and it ends with Parquet's footer.
  Files and folders whose names start with ``.`` are skipped (writers' temporary files).
- **Bad lines.** A line that is not a JSON object, or a CSV row that does not fit the header, is
  logged (file and line) and counted (``bad_lines`` in the status), never appended.
- **No loss, no duplicate.** Changes are appended in durable batches of at most
  ``batch_records``, and each file's position is saved in the state file once its batch is
  durable. A reader killed between the two finds, on start, the positions of what it had
  appended in the last records of its topics, and resumes after them. A file's changes all go to
  one partition of its topic, in order.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson

from headwater.bus.base import Bus
from headwater.errors import TransientError
from headwater.transport.config import FilesReaderConfig
from headwater.transport.message import Change, Mode, Op, now_ms, topic_name
from headwater.transport.reader import Reader, log_tail, wait_durable

if TYPE_CHECKING:
    import pyarrow as pa


log = logging.getLogger(__name__)
READ_BYTES = 1 << 20
PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 10_000
RETRY_S = 1.0  # after the log refused an append
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


class BadLine(ValueError):
    """A line (a row) that cannot become a change."""


@dataclass
class FileState:
    """How far a file is read: ``offset`` in bytes (rows for Parquet), the lines before it, the
    bad lines among them, and (Parquet) whether the whole file is read."""

    offset: int = 0
    lines: int = 0
    bad_lines: int = 0
    done: bool = False

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> FileState:
        return cls(
            offset=int(body.get("offset", 0)),
            lines=int(body.get("lines", 0)),
            bad_lines=int(body.get("bad_lines", 0)),
            done=bool(body.get("done", False)),
        )


# -- rows: pure functions -------------------------------------------------------------------


def json_row(line: bytes) -> dict[str, Any] | None:
    """The object on a JSON line; None for a blank line; ``BadLine`` says what is wrong."""
    if not line.strip():
        return None
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise BadLine(f"is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise BadLine(f"is {_JSON_TYPES.get(type(value), 'a JSON value')}, not a JSON object")
    return value


def csv_row(header: list[str], fields: list[str]) -> dict[str, str] | None:
    """The row of ``fields`` under ``header``; None for a blank line."""
    if not fields:
        return None
    if len(fields) != len(header):
        raise BadLine(f"has {len(fields)} fields where the header has {len(header)}")
    return dict(zip(header, fields, strict=True))


def plain(value: Any) -> Any:
    """``value`` as JSON holds it: decimals as text, bytes as base64, other values without a
    JSON form (durations, nanosecond timestamps) as text; lists and maps inside too."""
    if value is None or type(value) in (str, int, float, bool, datetime.datetime, datetime.date):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime.date):  # a subclass: pandas' Timestamp (nanoseconds)
        return value.isoformat()
    if isinstance(value, Decimal | datetime.timedelta | datetime.time):
        return str(value)
    return str(value)


def _simple(t: pa.DataType) -> bool:
    """Whether pyarrow gives values of type ``t`` as Python values JSON holds as they are."""
    import pyarrow as pa

    if pa.types.is_timestamp(t):
        return t.unit != "ns"
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date(t)
        or pa.types.is_null(t)
    )


def complete_lines(f: BinaryIO, offset: int) -> Iterator[tuple[bytes, int]]:
    """The lines of ``f`` from ``offset`` on that end with a newline (given without it), each
    with the offset after it; a last line without its newline is left for later."""
    f.seek(offset)
    rest = b""
    while block := f.read(READ_BYTES):
        data = rest + block if rest else block
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            offset += end + 1 - start
            yield data[start:end], offset
            start = end + 1
        rest = data[start:]


class _LineFeed:
    """The complete lines of a file as text for ``csv.reader``, knowing where the last line it
    gave ends and how many it gave."""

    def __init__(self, f: BinaryIO, offset: int) -> None:
        self._lines = complete_lines(f, offset)
        self.end = offset
        self.count = 0
        self.exhausted = False

    def __iter__(self) -> _LineFeed:
        return self

    def __next__(self) -> str:
        try:
            line, self.end = next(self._lines)
        except StopIteration:
            self.exhausted = True
            raise
        self.count += 1
        return line.decode("utf-8", "replace") + "\n"


def csv_header(path: Path) -> tuple[list[str], int] | None:
    """A CSV file's column names and the offset after its header; None while the header is not
    complete. ``BadLine`` when it cannot be parsed."""
    with open(path, "rb") as f:
        feed = _LineFeed(f, 0)
        try:
            names = next(csv.reader(feed, strict=True))
        except StopIteration:
            return None
        except csv.Error as e:
            if feed.exhausted:
                return None
            raise BadLine(f"has a header that is not valid CSV ({e})") from None
    if names:
        names[0] = names[0].removeprefix("\ufeff")
    return names, feed.end


def _count_lines(path: Path, start: int, end: int) -> int:
    """The newlines of ``path`` between two offsets."""
    count = 0
    with open(path, "rb") as f:
        f.seek(start)
        while start < end and (block := f.read(min(READ_BYTES, end - start))):
            count += block.count(b"\n")
            start += len(block)
    return count


# -- the reader ------------------------------------------------------------------------------


class FilesReader(Reader):
    """Reads a directory of JSON lines, CSV or Parquet files onto the log."""

    config: FilesReaderConfig

    def __init__(self, config: FilesReaderConfig, bus: Bus, state_dir: Path) -> None:
        super().__init__(config, bus, state_dir)
        self._files: dict[str, FileState] = {}
        self._touched: set[str] = set()  # files whose figures changed since the last report
        self._headers: dict[str, tuple[list[str], int]] = {}  # CSV header and where it ends
        self._seen: dict[str, tuple[int, int]] = {}  # Parquet: (size, mtime) at the last poll
        self._broken: dict[str, tuple[int, int]] = {}  # files that failed, as they were then
        self._missing_logged = False
        self.changes = 0  # appended by this process
        self.passes = 0  # looks at the directory by this process

    # -- run --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self._recover()
                    self._loop(stop)
                except TransientError as e:
                    log.warning(
                        "files reader %s: %s; reading again from the log's position in %.0f s",
                        self.config.id,
                        e,
                        RETRY_S,
                    )
                    self.report(force=True, error=str(e))
                    stop.wait(RETRY_S)
        finally:
            self._report(force=True, running=False)

    def _loop(self, stop: threading.Event) -> None:
        self._report(force=True, running=True, error=None)
        while not stop.is_set():
            for rel, path in self._list():
                if stop.is_set():
                    break
                self._read(rel, path, stop)
            self._flush(stop)
            self._report()
            self.passes += 1
            stop.wait(self.config.poll_s)

    # -- state ------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Load the state, then move each file's position up to what the log already holds."""
        state = self.load_state()
        self._files = {
            rel: FileState.from_dict(body) for rel, body in state.get("files", {}).items()
        }
        self._headers.clear()
        window = max(self.config.batch_records, int(state.get("window", 0)))
        by_topic: dict[str, set[str]] = {}
        for rel in set(self._files) | {rel for rel, _ in self._list()}:
            topic = topic_name(self.config.topic, self.config.id, rel)
            by_topic.setdefault(topic, set()).add(rel)
        for topic, names in sorted(by_topic.items()):
            self._recover_topic(topic, names, window)
        self._touched |= set(self._files)
        self._save()

    def _recover_topic(self, topic: str, names: set[str], window: int) -> None:
        """Catch up with the newest change of each file in ``topic``'s last records."""
        for change in log_tail(self.bus, topic, window):
            rel, at = _split_position(change.position)
            if rel in names and rel == change.namespace and at is not None:
                self._catch_up(rel, at)
                names.discard(rel)
                if not names:
                    return

    def _catch_up(self, rel: str, offset: int) -> None:
        """Set ``rel``'s position to ``offset``, found on the log, if it is further on."""
        st = self._files.setdefault(rel, FileState())
        if offset <= st.offset:
            return
        if self.config.format == "parquet":
            st.lines = offset
        else:
            with contextlib.suppress(FileNotFoundError):
                st.lines += _count_lines(self.config.path / rel, st.offset, offset)
        st.offset = offset

    def _save(self) -> None:
        files = {rel: asdict(st) for rel, st in self._files.items()}
        self.save_state({"files": files, "window": self.config.batch_records})

    def _flush(self, stop: threading.Event) -> None:
        """Append what is pending; once it is durable, save every file's position."""
        futures = self.appender.send()
        if futures and not wait_durable(futures, stop):
            return
        if futures or self._touched:
            self._save()

    # -- status -----------------------------------------------------------------------------
    def _report(self, force: bool = False, **fields: Any) -> None:
        for rel in self._touched:
            st = self._files.get(rel)
            if st is not None:
                position = f"{rel}:{st.offset}"
                self.phase(rel, "sync", position=position, lines=st.lines, bad_lines=st.bad_lines)
        self._touched.clear()
        bad = sum(st.bad_lines for st in self._files.values())
        self.report(
            force=force, files=len(self._files), bad_lines=bad, changes=self.changes, **fields
        )

    # -- files ------------------------------------------------------------------------------
    def _list(self) -> list[tuple[str, Path]]:
        """The files to read, by relative path."""
        root = self.config.path
        if not root.is_dir():
            if not self._missing_logged:
                log.warning("files reader %s: %s is not a directory (yet)", self.config.id, root)
                self._missing_logged = True
            return []
        found = []
        for path in root.glob(self.config.glob):
            parts = path.relative_to(root).parts
            if not any(p.startswith(".") for p in parts) and path.is_file():
                found.append(("/".join(parts), path))
        return sorted(found)

    def _read(self, rel: str, path: Path, stop: threading.Event) -> None:
        """Read what is new in one file."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        seen = (stat.st_size, stat.st_mtime_ns)
        if self._broken.get(rel) == seen:
            return
        read: Callable[[str, Path, os.stat_result, threading.Event], None]
        read = {"jsonl": self._read_jsonl, "csv": self._read_csv, "parquet": self._read_parquet}[
            self.config.format
        ]
        try:
            read(rel, path, stat, stop)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:  # pyarrow's errors are one or the other
            log.error("files reader %s: cannot read %s: %s", self.config.id, path, e)
            self._broken[rel] = seen
            self.report(force=True, error=f"{rel}: {e}")

    def _state(self, rel: str, size: int) -> FileState:
        """``rel``'s state; a file now shorter than its position was replaced: read it again."""
        st = self._files.setdefault(rel, FileState())
        if size < st.offset and self.config.format != "parquet":
            log.warning(
                "files reader %s: %s is now shorter (%d bytes) than its position (%d): it is "
                "read again from its start",
                self.config.id,
                rel,
                size,
                st.offset,
            )
            self._files[rel] = st = FileState()
            self._headers.pop(rel, None)
        return st

    def _read_jsonl(
        self, rel: str, path: Path, stat: os.stat_result, stop: threading.Event
    ) -> None:
        st = self._state(rel, stat.st_size)
        if stat.st_size == st.offset:
            return
        with open(path, "rb") as f:
            for line, end in complete_lines(f, st.offset):
                st.lines += 1
                try:
                    row = json_row(line)
                except BadLine as e:
                    self._bad(rel, st, e)
                    row = None
                if row is not None:
                    self._add(rel, row, f"{rel}:{end}")
                st.offset = end
                self._touched.add(rel)
                if self._full() and not self._flush_now(stop):
                    return

    def _read_csv(self, rel: str, path: Path, stat: os.stat_result, stop: threading.Event) -> None:
        st = self._state(rel, stat.st_size)
        if stat.st_size == st.offset:
            return
        header = self._headers.get(rel) or csv_header(path)
        if header is None:
            return
        self._headers[rel] = header
        names, body = header
        if st.offset < body:
            st.offset, st.lines = body, _count_lines(path, 0, body)
        with open(path, "rb") as f:
            feed = _LineFeed(f, st.offset)
            rows = csv.reader(feed, strict=True)
            base = st.lines
            while True:
                try:
                    row = csv_row(names, next(rows))
                except StopIteration:
                    return
                except (csv.Error, BadLine) as e:
                    if feed.exhausted:  # a quoted value goes on past the last newline
                        return
                    st.lines = base + feed.count
                    self._bad(
                        rel, st, e if isinstance(e, BadLine) else BadLine(f"is not valid CSV ({e})")
                    )
                    row = None
                if row is not None:
                    self._add(rel, row, f"{rel}:{feed.end}")
                st.offset, st.lines = feed.end, base + feed.count
                self._touched.add(rel)
                if self._full() and not self._flush_now(stop):
                    return

    def _read_parquet(
        self, rel: str, path: Path, stat: os.stat_result, stop: threading.Event
    ) -> None:
        st = self._state(rel, stat.st_size)
        if st.done:
            return
        seen = (stat.st_size, stat.st_mtime_ns)
        if self._seen.get(rel) != seen or not _ends_with_footer(path, stat.st_size):
            self._seen[rel] = seen  # read once it stays the same for a poll
            return
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as pf:
            groups, index = _row_groups_from(pf.metadata, st.offset)
            convert = not all(_simple(field.type) for field in pf.schema_arrow)
            batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups)
            for batch in batches if groups else ():
                for row in batch.to_pylist():
                    index += 1
                    if index <= st.offset:
                        continue
                    self._add(rel, plain(row) if convert else row, f"{rel}:{index}")
                    st.offset = st.lines = index
                    self._touched.add(rel)
                    if self._full() and not self._flush_now(stop):
                        return
        st.done = True
        self._touched.add(rel)

    # -- appending --------------------------------------------------------------------------
    def _add(self, rel: str, row: dict[str, Any], position: str) -> None:
        change = Change(Op.INSERT, rel, now_ms(), data=row, position=position)
        self.appender.add(change, Mode.SYNC, pin=rel)
        self.changes += 1

    def _bad(self, rel: str, st: FileState, error: BadLine) -> None:
        st.bad_lines += 1
        log.warning("files reader %s: %s line %d %s; skipped", self.config.id, rel, st.lines, error)

    def _full(self) -> bool:
        return self.appender.count >= self.config.batch_records

    def _flush_now(self, stop: threading.Event) -> bool:
        """Flush a full batch; False when the reader is told to stop."""
        self._flush(stop)
        self._report()
        return not stop.is_set()


def _split_position(position: str | None) -> tuple[str | None, int | None]:
    """A position's file and offset: ``dir/a.jsonl:1234`` -> ``("dir/a.jsonl", 1234)``."""
    if position is None:
        return None, None
    rel, _, at = position.rpartition(":")
    return (rel, int(at)) if rel and at.isdigit() else (None, None)


def _ends_with_footer(path: Path, size: int) -> bool:
    """Whether a Parquet file is whole: it ends with the footer's magic bytes."""
    if size < 2 * len(PARQUET_MAGIC):
        return False
    with open(path, "rb") as f:
        f.seek(size - len(PARQUET_MAGIC))
        return f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC


def _row_groups_from(metadata: Any, rows: int) -> tuple[list[int], int]:
    """The row groups holding the rows after the first ``rows``, and how many rows come
    before them."""
    before = 0
    for i in range(metadata.num_row_groups):
        count = metadata.row_group(i).num_rows
        if before + count > rows:
            return list(range(i, metadata.num_row_groups)), before
        before += count
    return [], before
