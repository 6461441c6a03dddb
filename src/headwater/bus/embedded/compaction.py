"""Compaction of closed segments (seed 003, "Log Compaction").

Below ``cutoff`` (the lowest offset a registered writer has committed) only the latest record of
each key is kept; records at or above it, records without a key, and the whole active segment are
left untouched. Offsets never change: a rewritten batch keeps its records' offsets and its span.
A segment is rewritten to ``<base>.log.cleaned`` and renamed over the original, so a crash leaves
either the old or the new file (a stray ``.cleaned`` is removed on open).
"""

from __future__ import annotations

import os
from pathlib import Path

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.partition import Partition, sync_dir
from headwater.bus.embedded.segment import BadBatchAt, Segment
from headwater.bus.records import CompactionResult


def compact_partition(p: Partition, cutoff: int) -> CompactionResult:
    with p.maintenance:
        closed = p.closed_segments()
        latest = _latest_per_key(p, cutoff)
        before = after = bytes_before = bytes_after = segments = 0
        for seg in closed:
            if seg.base_offset >= cutoff:
                break
            kept, removed, size = _rewrite(p, seg, cutoff, latest)
            before += kept + removed
            after += kept
            bytes_before += seg.size
            bytes_after += size if removed else seg.size
            segments += 1 if removed else 0
    return CompactionResult(p.topic, p.index, segments, before, after, bytes_before, bytes_after)


def _latest_per_key(p: Partition, cutoff: int) -> dict[bytes, int]:
    latest: dict[bytes, int] = {}
    with p.lock:
        segments = list(p.segments)
    for seg in segments:
        if seg.base_offset >= cutoff or not seg.acquire():
            break
        try:
            for _, header, buf, at in _batches(seg):
                if header.base_offset >= cutoff:
                    break
                cols = fmt.decode_columns(buf, at, header)
                for offset, key in zip(cols.offsets, cols.keys, strict=True):
                    if key is not None and offset < cutoff:
                        latest[key] = offset
        finally:
            seg.release()
    return latest


def _batches(seg: Segment):  # noqa: ANN202 - a generator of segment batches
    try:
        yield from seg.batches(0, seg.size, verify=True)
    except BadBatchAt as bad:
        raise bad.as_corrupt() from None


def _rewrite(
    p: Partition, seg: Segment, cutoff: int, latest: dict[bytes, int]
) -> tuple[int, int, int]:
    """Rewrite one closed segment; return (records kept, records removed, new size)."""
    cleaned = Path(f"{seg.path}.cleaned")
    kept = removed = 0
    with open(cleaned, "wb") as out:
        for _, header, buf, at in _batches(seg):
            cols = fmt.decode_columns(buf, at, header)
            keep = [
                o >= cutoff or k is None or latest.get(k) == o
                for o, k in zip(cols.offsets, cols.keys, strict=True)
            ]
            n = sum(keep)
            kept += n
            removed += header.count - n
            if n == header.count:
                out.write(memoryview(buf)[at : at + header.length])
            elif (rebuilt := fmt.rebuild(cols, keep, header)) is not None:
                out.write(fmt.frame(rebuilt, header.base_offset))
        out.flush()
        os.fdatasync(out.fileno())
        size = out.tell()
    if not removed:
        cleaned.unlink()
        return kept, 0, seg.size

    def swap() -> Segment:
        seg.remove_index()  # a stale index must never describe the new file
        os.replace(cleaned, seg.path)
        sync_dir(seg.path.parent)
        new = Segment(seg.path.parent, seg.base_offset, writable=p.writable)
        new.open_existing(p.config.index_interval_bytes, trust_index=False)
        new.write_index()
        return new

    p.replace_segment(seg, swap)
    return kept, removed, size
