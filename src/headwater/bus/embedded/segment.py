"""A segment: one file of batches, named by its base offset, with a sparse offset index.

The index maps a record offset to a byte position at most ``index_interval_bytes`` before the
batch that holds it. It lives in memory and is written to ``<base>.index`` when the segment is
closed (rolled) and on clean shutdown; a segment whose index file is missing is scanned.

The batches this process appended last are known exactly (``RECENT_BATCHES`` of them): a
consumer at the tail asks for the first offset of a batch, and reads from that batch, not from
the index's position up to ``index_interval_bytes`` before it (parsing and checking every batch
in between again, at every poll).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path

from headwater.bus.embedded import format as fmt
from headwater.bus.errors import CorruptLog

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024

INDEX_MAGIC = b"HWI2"
# magic, next_offset, max_timestamp, records, entries, the segment's size it describes
_INDEX_HEAD = struct.Struct("<4sqqqIq")
SCAN_CHUNK = 1 << 20
RECENT_BATCHES = 1024  # batch starts remembered (then forgotten at once, and remembered anew)
DROP_STEP = 8 << 20  # drop synced data from the page cache in steps of at least this
_DROP_ALIGN = 1 << 20


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


class Segment:
    """One segment file. Appends are serialised by the partition; reads use ``pread``."""

    def __init__(self, directory: Path, base_offset: int, *, writable: bool) -> None:
        self.base_offset = base_offset
        self.path = directory / f"{segment_name(base_offset)}.log"
        self.index_path = directory / f"{segment_name(base_offset)}.index"
        flags = (os.O_RDWR | os.O_CREAT | os.O_APPEND) if writable else os.O_RDONLY
        self.fd = os.open(self.path, flags, 0o644)
        self.size = 0
        self.next_offset = base_offset
        self.max_timestamp = -1
        self.records = 0
        self._index_offsets = array("q")
        self._index_positions = array("q")
        self._last_indexed = -(1 << 62)
        self._index_interval = 4096
        self._recent: dict[int, int] = {}  # a recent batch's base offset -> its position
        self._readers = 0
        self._retired = False
        self._dropped = 0  # the page cache holds nothing of the file before this byte
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------
    def open_existing(self, index_interval: int, *, trust_index: bool) -> None:
        """Load the index (when trusted and present) or scan the file to build it."""
        self._index_interval = index_interval
        if trust_index and self._load_index():
            return
        self._scan_all()

    def _load_index(self, *, prefix: bool = False) -> bool:
        """Take the index (False when it is missing or unusable). It describes the segment up
        to the size it records: that must be the whole file, or with ``prefix`` (a read-only
        open of a segment a writer may append to) a part of it."""
        try:
            data = self.index_path.read_bytes()
        except FileNotFoundError:
            return False
        if len(data) < _INDEX_HEAD.size:
            return False
        magic, next_offset, max_ts, records, entries, size = _INDEX_HEAD.unpack_from(data)
        body = memoryview(data)[_INDEX_HEAD.size :]
        if magic != INDEX_MAGIC or len(body) != 16 * entries:
            return False
        file_size = os.fstat(self.fd).st_size
        if size > file_size or (size != file_size and not prefix):
            return False
        pairs = array("q")
        pairs.frombytes(body)
        self._index_offsets = pairs[0::2]
        self._index_positions = pairs[1::2]
        if self._index_positions and self._index_positions[-1] >= max(size, 1):
            return False
        self.size = size
        self.next_offset = next_offset
        self.max_timestamp = max_ts
        self.records = records
        if self._index_positions:
            self._last_indexed = self._index_positions[-1]
        return True

    def write_index(self) -> None:
        """Persist the index with the segment's summary (atomically)."""
        pairs = array("q", [0]) * (2 * len(self._index_offsets))
        pairs[0::2] = self._index_offsets
        pairs[1::2] = self._index_positions
        head = _INDEX_HEAD.pack(
            INDEX_MAGIC,
            self.next_offset,
            self.max_timestamp,
            self.records,
            len(self._index_offsets),
            self.size,
        )
        tmp = self.index_path.with_suffix(".index.tmp")
        with open(tmp, "wb") as f:
            f.write(head + pairs.tobytes())
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, self.index_path)

    def remove_index(self) -> None:
        self.index_path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._retired = True
            if self._readers == 0 and self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def delete(self) -> None:
        """Unlink the files; the descriptor closes once the last reader is done."""
        self.path.unlink(missing_ok=True)
        self.index_path.unlink(missing_ok=True)
        self.close()

    # -- readers hold the descriptor open while they use it -----------------------------------
    def acquire(self) -> bool:
        with self._lock:
            if self._retired:
                return False
            self._readers += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._retired and self._readers == 0 and self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    # -- writing ----------------------------------------------------------------------------
    def append(
        self,
        parts: Sequence[bytes | memoryview],
        size: int,
        batches: list[tuple[int, int, int, int]],
        next_offset: int,
    ) -> None:
        """Write ``parts`` (``size`` bytes, one ``writev`` per ``IOV_MAX`` parts) holding
        ``batches`` as (base_offset, position in the parts, count, max_timestamp)."""
        position = self.size
        written = 0
        for i in range(0, len(parts), _IOV_MAX):
            chunk = parts[i : i + _IOV_MAX]
            want = sum(map(len, chunk))
            done = os.writev(self.fd, chunk)
            written += done
            if done != want:  # a short write on a regular file: out of space or similar
                os.ftruncate(self.fd, position)
                raise OSError(f"short write to {self.path}: {written} of {size} bytes")
        self.size = position + size
        self.next_offset = next_offset
        for base_offset, at, count, max_ts in batches:
            self.records += count
            if max_ts > self.max_timestamp:
                self.max_timestamp = max_ts
            self._note_batch(base_offset, position + at)

    def _note_batch(self, base_offset: int, position: int) -> None:
        if len(self._recent) >= RECENT_BATCHES:
            self._recent = {}  # (a new dict: a reader may be looking in the old one)
        self._recent[base_offset] = position
        if position - self._last_indexed >= self._index_interval or not self._index_offsets:
            self._index_positions.append(position)  # positions first: readers bisect offsets
            self._index_offsets.append(base_offset)
            self._last_indexed = position

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def drop_cached(self, synced: int, keep: int) -> None:
        """Drop the file's bytes more than ``keep`` before ``synced`` (a size known to be
        fdatasync'd, so clean pages) from the page cache; in steps of ``DROP_STEP`` or more."""
        upto = (synced - keep) & ~(_DROP_ALIGN - 1)
        if upto - self._dropped < DROP_STEP:
            return
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self._dropped, upto - self._dropped, os.POSIX_FADV_DONTNEED)
        self._dropped = upto

    def truncate(self, size: int) -> None:
        self._recent = {}
        os.ftruncate(self.fd, size)
        os.fdatasync(self.fd)
        self.size = size

    # -- reading ----------------------------------------------------------------------------
    def position_for(self, offset: int) -> int:
        """A byte position at or before the batch holding ``offset``."""
        found = self._recent.get(offset)
        if found is not None:  # the start of a batch appended lately
            return found
        i = bisect_right(self._index_offsets, offset) - 1
        return self._index_positions[i] if i >= 0 else 0

    def pread(self, length: int, position: int) -> bytes:
        return os.pread(self.fd, length, position)

    def batches(
        self, start: int, end: int, *, verify: bool
    ) -> Iterator[tuple[int, fmt.BatchHeader, bytes, int]]:
        """Yield ``(position, header, buffer, offset_in_buffer)`` for each batch in
        ``[start, end)``; a bad batch raises ``BadBatchAt``."""
        pos = start
        expected = self.base_offset if start == 0 else -1
        while pos < end:
            chunk = self.pread(min(SCAN_CHUNK, end - pos), pos)
            at = 0
            while at < len(chunk):
                if at and len(chunk) - at < fmt.HEADER_SIZE:
                    break  # the next header straddles the chunk's end: read on from it
                try:
                    header = fmt.parse_header(chunk, at, end - pos - at)
                except fmt.BadBatch as e:
                    raise BadBatchAt(self.path, pos + at, e, expected) from None
                if at + header.length > len(chunk):
                    if at == 0:  # a batch larger than the chunk: read it whole
                        chunk = self.pread(header.length, pos)
                    else:
                        break
                if verify:
                    try:
                        fmt.check_crc(chunk, at, header)
                    except fmt.BadBatch as e:
                        raise BadBatchAt(self.path, pos + at, e, expected) from None
                yield pos + at, header, chunk, at
                expected = header.next_offset
                at += header.length
            pos += at

    # -- recovery ---------------------------------------------------------------------------
    def _scan_all(self) -> None:
        """Walk every batch, verifying checksums, and rebuild the index and summary."""
        self._index_offsets = array("q")
        self._index_positions = array("q")
        self._last_indexed = -(1 << 62)
        self.records = 0
        self.size = 0
        self._extend(os.fstat(self.fd).st_size)

    def _extend(self, file_size: int) -> None:
        for position, header, _, _ in self.batches(self.size, file_size, verify=True):
            self._note_batch(header.base_offset, position)
            self.size = position + header.length
            self.next_offset = header.next_offset
            self.records += header.count
            self.max_timestamp = max(self.max_timestamp, header.max_timestamp)

    def recover_tail(self, index_interval: int) -> int | None:
        """Scan the whole file; truncate a torn or corrupt *last* batch. Returns the number of
        bytes truncated, or None. Corruption followed by valid batches raises ``CorruptLog``."""
        self._index_interval = index_interval
        try:
            self._scan_all()
            return None
        except BadBatchAt as bad:
            file_size = os.fstat(self.fd).st_size
            if self._valid_batch_after(bad.position, file_size):
                raise bad.as_corrupt() from None
            self.truncate(bad.position)
            return file_size - bad.position

    def _valid_batch_after(self, position: int, file_size: int) -> bool:
        """Whether some intact batch starts after ``position`` (so the damage is not a tail)."""
        data = self.pread(file_size - position, position)
        at = data.find(fmt.MAGIC, 1)
        while at != -1:
            try:
                header = fmt.parse_header(data, at, len(data) - at)
                fmt.check_crc(data, at, header)
                return True
            except fmt.BadBatch:
                at = data.find(fmt.MAGIC, at + 1)
        return False

    def open_tail(self, index_interval: int) -> None:
        """Read-only open of a segment another process may be appending to. A writer removes
        the active segment's index when it opens it, so an index that is there describes
        checked batches: only what follows it is scanned (a reader of a big, closed log would
        otherwise verify every byte of the segment before its first read)."""
        self._index_interval = index_interval
        self._load_index(prefix=True)
        self.refresh_tail()

    def refresh_tail(self) -> None:
        """Read-only: extend ``size`` over complete, valid batches another process appended."""
        file_size = os.fstat(self.fd).st_size
        if file_size > self.size:
            with contextlib.suppress(BadBatchAt):  # an append in progress, or a torn tail
                self._extend(file_size)


class BadBatchAt(Exception):
    """A bad batch at a byte position of a segment file."""

    def __init__(
        self, path: Path, position: int, error: fmt.BadBatch, next_offset: int = -1
    ) -> None:
        super().__init__(f"{path} at byte {position}: {error.reason}")
        self.next_offset = next_offset
        self.path = path
        self.position = position
        self.error = error

    def as_corrupt(self) -> CorruptLog:
        return CorruptLog(
            f"corrupt batch in {self.path} at byte {self.position}"
            f"{self._after()}: {self.error.reason}"
        )

    def _after(self) -> str:
        return f" (records from offset {self.next_offset})" if self.next_offset >= 0 else ""
