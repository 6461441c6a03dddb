"""A partition of a topic: an ordered run of segments, the last one active.

Appends are serialised by the partition's lock and go to the active segment, which rolls once it
reaches ``segment_bytes``. Readers see records up to the high watermark: under ``always``
durability that is what has been fdatasync'd, otherwise what has been written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.embedded.segment import BadBatchAt, Segment
from headwater.bus.errors import OffsetOutOfRange
from headwater.bus.records import Record

log = logging.getLogger(__name__)


class BatchSpan(NamedTuple):
    """A checked batch in a buffer read from a segment, and the records of it to read: indices
    ``[first, stop)`` (a columnar reader decodes the batch whole and slices)."""

    buf: bytes
    at: int
    header: fmt.BatchHeader
    first: int
    stop: int


class Partition:
    def __init__(
        self,
        topic: str,
        index: int,
        directory: Path,
        config: EmbeddedBusConfig,
        *,
        writable: bool,
    ) -> None:
        self.topic = topic
        self.index = index
        self.directory = directory
        self.config = config
        self.writable = writable
        self.lock = threading.Lock()
        self.maintenance = threading.Lock()  # compaction and retention, one at a time
        self.segments: list[Segment] = []
        self.bases: list[int] = []
        self.next_offset = 0
        self.durable_offset = 0  # readers see records below this
        self.synced_offset = 0  # fdatasync'd up to here
        self._dirty = False
        self._unsynced: list[Segment] = []  # rolled segments whose data is not yet durable
        self._droppable: dict[Segment, int] = {}  # synced sizes, for ``drop_synced``

    # -- opening ----------------------------------------------------------------------------
    def open(self, *, clean: bool) -> None:
        """Load the segments. After an unclean shutdown the active segment is scanned and a torn
        or corrupt tail batch is truncated (a writable open only)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stray in self.directory.glob("*.cleaned"):
            if self.writable:
                stray.unlink()
        bases = sorted(int(p.stem) for p in self.directory.glob("*.log"))
        if not bases and self.writable:
            bases = [0]
        interval = self.config.index_interval_bytes
        for i, base in enumerate(bases):
            seg = Segment(self.directory, base, writable=self.writable)
            last = i == len(bases) - 1
            if last and self.writable and not clean:
                cut = seg.recover_tail(interval)
                if cut:
                    log.warning("truncated a torn tail of %d bytes from %s", cut, seg.path)
            elif last and not self.writable:
                seg.open_tail(interval)  # another process may be appending to it
            else:
                try:
                    seg.open_existing(interval, trust_index=not last or clean)
                except BadBatchAt as bad:
                    raise bad.as_corrupt() from None
            if last and self.writable:
                seg.remove_index()  # the active segment's index is rewritten on clean close
            self.segments.append(seg)
            self.bases.append(base)
        if self.segments:
            self.next_offset = self.segments[-1].next_offset
        self.durable_offset = self.synced_offset = self.next_offset

    def refresh(self) -> None:
        """Read-only: pick up segments and records another process has written since."""
        on_disk = sorted(int(p.stem) for p in self.directory.glob("*.log"))
        with self.lock:
            if on_disk != self.bases:
                known = {s.base_offset: s for s in self.segments}
                fresh: list[Segment] = []
                for base in on_disk:
                    seg = known.pop(base, None)
                    if seg is None:
                        seg = Segment(self.directory, base, writable=False)
                        seg.open_existing(self.config.index_interval_bytes, trust_index=False)
                    fresh.append(seg)
                for gone in known.values():
                    gone.close()
                self.segments, self.bases = fresh, on_disk
            if self.segments:
                self.segments[-1].refresh_tail()
                self.next_offset = self.durable_offset = self.segments[-1].next_offset

    # -- writing ----------------------------------------------------------------------------
    def write(self, batches: list[fmt.EncodedBatch]) -> list[int]:
        """Frame and write batches (one ``writev`` per segment, the bodies as they are);
        return their base offsets."""
        limit = self.config.segment_bytes
        bases: list[int] = []
        with self.lock:
            seg = self.segments[-1]
            parts: list[bytes | memoryview] = []
            entries: list[tuple[int, int, int, int]] = []
            at = 0
            for batch in batches:
                if seg.size + at >= limit and (seg.size or at):
                    if parts:
                        seg.append(parts, at, entries, self.next_offset)
                        parts, entries, at = [], [], 0
                    seg = self._roll()
                base = self.next_offset
                parts += (fmt.frame_header(batch, base), batch.body)
                entries.append((base, at, batch.count, batch.max_timestamp))
                at += fmt.HEADER_SIZE + len(batch.body)
                self.next_offset = base + batch.last_offset_delta + 1
                bases.append(base)
            if parts:
                seg.append(parts, at, entries, self.next_offset)
            self._dirty = True
        return bases

    def _roll(self) -> Segment:
        old = self.segments[-1]
        old.write_index()
        self._unsynced.append(old)
        seg = Segment(self.directory, self.next_offset, writable=True)
        seg.open_existing(self.config.index_interval_bytes, trust_index=False)
        self.segments.append(seg)
        self.bases.append(seg.base_offset)
        sync_dir(self.directory)
        return seg

    def sync(self) -> int:
        """fdatasync what has been written; return (and remember in ``synced_offset``) the
        offset it is now durable up to."""
        with self.lock:
            if not self._dirty:
                return self.synced_offset
            self._dirty = False
            upto = self.next_offset
            segs = [(seg, seg.size) for seg in (*self._unsynced, self.segments[-1])]
            self._unsynced = []
        try:
            for seg, _ in segs:
                seg.sync()
        except OSError:
            with self.lock:
                self._dirty = True
            raise
        self.synced_offset = max(self.synced_offset, upto)
        if self.config.page_cache_bytes:
            with self.lock:
                self._droppable.update(segs)
        return upto

    def drop_synced(self) -> None:
        """Drop synced data older than the most recent ``page_cache_bytes`` from the page cache.
        Megabytes of pages take most of a millisecond: the log's writer does it after telling
        the appenders, not between one fdatasync and the next."""
        with self.lock:
            droppable, self._droppable = self._droppable, {}
        for seg, size in droppable.items():
            with contextlib.suppress(OSError):  # (a segment retention has just closed)
                seg.drop_cached(size, self.config.page_cache_bytes)

    def mark_durable(self, upto: int) -> None:
        if upto > self.durable_offset:
            self.durable_offset = upto

    # -- reading ----------------------------------------------------------------------------
    def watermarks(self, visible: int) -> tuple[int, int]:
        low = self.bases[0] if self.bases else 0
        return low, visible

    def _readable(self, offset: int, visible: int) -> int:
        """The high watermark; raises ``OffsetOutOfRange`` for an offset outside the log."""
        low, high = self.watermarks(visible)
        if offset < low or offset > high:
            raise OffsetOutOfRange(
                f"offset {offset} is out of range for {self.topic}/{self.index}: "
                f"readable offsets are {low} to {high} (exclusive)"
            )
        return high

    def read(
        self, offset: int, max_records: int, max_bytes: int | None, visible: int
    ) -> list[Record]:
        high = self._readable(offset, visible)
        out: list[Record] = []
        budget = max_bytes if max_bytes is not None else 1 << 62
        i = bisect_right(self.bases, offset) - 1
        while offset < high and len(out) < max_records and budget > 0:
            seg = self.segments[i] if 0 <= i < len(self.segments) else None
            if seg is None or not seg.acquire():
                break
            try:
                offset, budget = self._read_segment(seg, offset, high, max_records, budget, out)
            finally:
                seg.release()
            i += 1
        return out

    def _read_segment(
        self,
        seg: Segment,
        offset: int,
        high: int,
        max_records: int,
        budget: int,
        out: list[Record],
    ) -> tuple[int, int]:
        for header, buf, at in _batches_from(seg, offset):
            if header.base_offset >= high:
                break
            records = fmt.decode_records(self.topic, self.index, buf, at, header, offset)
            room = max_records - len(out)
            if records and records[-1].offset >= high:
                records = [r for r in records if r.offset < high]
            if len(records) > room:
                records = records[:room]
            out += records
            budget -= header.length
            offset = records[-1].offset + 1 if records else header.next_offset
            if len(out) >= max_records or budget <= 0:
                return offset, budget
            offset = max(offset, header.next_offset)
        return max(offset, seg.next_offset), budget

    def spans(self, offset: int, end: int, max_records: int, visible: int) -> list[BatchSpan]:
        """The checked batches holding the records ``[offset, end)`` below the high watermark,
        at most ``max_records`` of them, without decoding them (a columnar reader's ``read``):
        the same segments, checksums, visibility and errors as ``read``."""
        limit = min(end, self._readable(offset, visible))
        out: list[BatchSpan] = []
        left = max_records
        i = bisect_right(self.bases, offset) - 1
        while offset < limit and left > 0:
            seg = self.segments[i] if 0 <= i < len(self.segments) else None
            if seg is None or not seg.acquire():
                break
            try:
                offset, left = self._segment_spans(seg, offset, limit, left, out)
            finally:
                seg.release()
            i += 1
        return out

    def _segment_spans(
        self, seg: Segment, offset: int, limit: int, left: int, out: list[BatchSpan]
    ) -> tuple[int, int]:
        for header, buf, at in _batches_from(seg, offset):
            if header.base_offset >= limit:
                return limit, left
            first, stop = fmt.record_range(buf, at, header, offset, limit)
            stop = min(stop, first + left)
            if stop > first:
                out.append(BatchSpan(buf, at, header, first, stop))
                left -= stop - first
            offset = header.next_offset
            if left <= 0:
                return offset, left
        return max(offset, seg.next_offset), left

    # -- maintenance ------------------------------------------------------------------------
    def closed_segments(self) -> list[Segment]:
        """Closed segments whose data is durable (compaction may rewrite those)."""
        with self.lock:
            return [
                s
                for s in self.segments[:-1]
                if s not in self._unsynced and s.next_offset <= self.durable_offset
            ]

    def replace_segment(self, old: Segment, make_new: Callable[[], Segment]) -> None:
        """Swap a closed segment for its rewritten file (compaction)."""
        with self.lock:
            i = self.segments.index(old)
            self.segments[i] = make_new()
        old.close()

    def enforce_retention(self, now_ms: int, protect_from: int | None) -> int:
        """Delete closed segments beyond the retention limits; return how many."""
        cfg = self.config.retention
        if cfg.bytes is None and cfg.ms is None:
            return 0
        deleted = 0
        with self.maintenance, self.lock:
            total = sum(s.size for s in self.segments)
            while len(self.segments) > 1:
                seg = self.segments[0]
                too_big = cfg.bytes is not None and total > cfg.bytes
                too_old = cfg.ms is not None and seg.max_timestamp < now_ms - cfg.ms
                if not (too_big or too_old):
                    break
                if protect_from is not None and seg.next_offset > protect_from:
                    break
                if seg in self._unsynced or seg.next_offset > self.durable_offset:
                    break  # not durable yet: the syncer still needs it
                self.segments.pop(0)
                self.bases.pop(0)
                total -= seg.size
                seg.delete()
                deleted += 1
        if deleted:
            sync_dir(self.directory)
        return deleted

    def close(self, *, clean: bool) -> None:
        with self.lock:
            segments = list(self.segments)
            unsynced, self._unsynced = self._unsynced, []
        if self.writable:
            for seg in [*unsynced, segments[-1]] if segments else unsynced:
                seg.sync()
            if clean and segments:
                segments[-1].write_index()
        for seg in segments:
            seg.close()

    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def record_count(self) -> int:
        return sum(s.records for s in self.segments)


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _batches_from(seg: Segment, offset: int) -> Iterator[tuple[fmt.BatchHeader, bytes, int]]:
    """``(header, buffer, offset_in_buffer)`` of each checked batch of ``seg`` that holds records
    at or after ``offset``, in order; a bad batch raises ``CorruptLog``."""
    try:
        for _, header, buf, at in seg.batches(seg.position_for(offset), seg.size, verify=True):
            if header.next_offset > offset:
                yield header, buf, at
    except BadBatchAt as bad:
        raise bad.as_corrupt() from None
