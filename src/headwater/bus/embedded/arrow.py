"""The embedded log's batches straight into Arrow, in the layout of Spark's Kafka source
(``headwater.bus.arrow.ARROW_SCHEMA``), with no Python object per record.

A stored batch is already columnar (see ``format``): arrays of offset deltas, timestamps, key,
value and header lengths, then the keys, values and headers blobs. So a group of batches becomes
one ``RecordBatch`` in a fixed number of numpy and Arrow operations per group: the fixed-width
columns are numpy views concatenated; keys and values are the blobs (one batch: the read buffer
itself, zero-copy; several: joined once) with offsets from a cumulative sum of the lengths. The
headers blob (per record a run of ``name_len u16 | name | value_len u32 | value``) is walked
"k-th header of every record" at a time, as many steps as the most headers a record has; then
one binary array over the blob whose elements are, per header, its name, its value length, its
value and the next header's name length, gives the names and the values with a ``take`` each.

A read starting or ending inside a batch slices the built batch (``RecordBatch.slice``): no copy.
Consecutive small batches (the collector appends a request's events together, often a few
hundred) are built together into batches of up to ``ROWS_PER_BATCH`` rows: a built batch has a
fixed cost of some 200 us, so one per stored batch of 100 records cost twice the time per
record. Building several together copies their keys, values and headers once, which costs more
than that fixed cost from about 1 MiB on: a stored batch that large is built alone, zero-copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from headwater.bus.arrow import ARROW_SCHEMA, CREATE_TIME, HEADER_TYPE, HEADERS_TYPE
from headwater.bus.arrow import TIMESTAMP_TYPE as TIMESTAMP
from headwater.bus.embedded.format import HEADER_SIZE
from headwater.bus.embedded.partition import BatchSpan
from headwater.bus.errors import CorruptLog

ROWS_PER_BATCH = 16_384
ALONE_BYTES = 1 << 20  # a stored batch this large is built alone
MAX_BYTES = 64 << 20  # stored bytes built together at most (Arrow's offsets are int32)
_INT32_MAX = (1 << 31) - 1

Ints = npt.NDArray[np.signedinteger[Any]]


def record_batches(topic: str, partition: int, spans: Sequence[BatchSpan]) -> list[pa.RecordBatch]:
    """The records the spans select, as Arrow batches: consecutive small stored batches built
    together, up to ``ROWS_PER_BATCH`` rows; a stored batch of ``ALONE_BYTES`` or more alone."""
    return [_build(topic, partition, group) for group in _groups(spans)]


def _groups(spans: Sequence[BatchSpan]) -> Iterator[Sequence[BatchSpan]]:
    """Runs of spans to build together. A large stored batch goes alone: built alone it is
    zero-copy, and copying it would cost more than the fixed cost of one more Arrow batch."""
    start = rows = size = 0
    for i, span in enumerate(spans):
        alone = span.header.length >= ALONE_BYTES
        full = rows + span.header.count > ROWS_PER_BATCH or size + span.header.length > MAX_BYTES
        if i > start and (alone or full):
            yield spans[start:i]
            start, rows, size = i, 0, 0
        if alone:
            yield spans[i : i + 1]
            start = i + 1
            continue
        rows += span.header.count
        size += span.header.length
    if start < len(spans):
        yield spans[start:]


class _Columns:
    """The fixed-width columns of a group of stored batches, concatenated, and where each
    batch's keys, values and headers blobs are."""

    def __init__(self, spans: Sequence[BatchSpan]) -> None:
        deltas, stamps, klens, vlens, hlens = [], [], [], [], []
        for span in spans:
            n, p = span.header.count, span.at + HEADER_SIZE
            deltas.append(np.frombuffer(span.buf, "<u4", n, p))
            stamps.append(np.frombuffer(span.buf, "<i8", n, p + 4 * n))
            klens.append(np.frombuffer(span.buf, "<i4", n, p + 12 * n))
            vlens.append(np.frombuffer(span.buf, "<u4", n, p + 16 * n))
            hlens.append(np.frombuffer(span.buf, "<u4", n, p + 20 * n))
        counts = np.array([s.header.count for s in spans], np.int64)
        bases = np.array([s.header.base_offset for s in spans], np.int64)
        self.n = int(counts.sum())
        self.offsets: Ints = np.repeat(bases, counts) + np.concatenate(deltas)
        self.stamps: Ints = np.concatenate(stamps).astype(np.int64)
        self.klens = np.concatenate(klens)
        self.ksizes: Ints = np.maximum(self.klens, 0).astype(np.int64)
        self.vsizes: Ints = np.concatenate(vlens).astype(np.int64)
        self.hsizes: Ints = np.concatenate(hlens).astype(np.int64)
        firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self._spans = spans
        self._ktotal = np.add.reduceat(self.ksizes, firsts)
        self._vtotal = np.add.reduceat(self.vsizes, firsts)
        self._htotal = np.add.reduceat(self.hsizes, firsts)

    def blobs(self) -> tuple[pa.Buffer, pa.Buffer, pa.Buffer]:
        """The keys, values and headers blobs of the group, each one contiguous buffer."""
        keys, values, headers = [], [], []
        for span, k, v, h in zip(
            self._spans,
            self._ktotal.tolist(),
            self._vtotal.tolist(),
            self._htotal.tolist(),
            strict=True,
        ):
            start = span.at + HEADER_SIZE + 24 * span.header.count
            view = memoryview(span.buf)
            keys.append(view[start : start + k])
            values.append(view[start + k : start + k + v])
            headers.append(view[start + k + v : start + k + v + h])
        return _joined(keys), _joined(values), _joined(headers)


def _joined(parts: list[memoryview]) -> pa.Buffer:
    """One buffer of the parts: the read buffer itself for one part (zero-copy), else a copy."""
    return pa.py_buffer(parts[0] if len(parts) == 1 else b"".join(parts))


def _build(topic: str, partition: int, spans: Sequence[BatchSpan]) -> pa.RecordBatch:
    c = _Columns(spans)
    key_blob, value_blob, header_blob = c.blobs()
    n = c.n
    valid = c.klens >= 0
    key_validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    columns = [
        pa.Array.from_buffers(pa.binary(), n, [key_validity, _ends(c.ksizes), key_blob]),
        pa.Array.from_buffers(pa.binary(), n, [None, _ends(c.vsizes), value_blob]),
        pa.repeat(pa.scalar(topic, pa.string()), n),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(c.offsets)]),
        pa.Array.from_buffers(TIMESTAMP, n, [None, pa.py_buffer(c.stamps * 1000)]),
        pa.repeat(pa.scalar(CREATE_TIME, pa.int32()), n),
        _headers(header_blob, c.hsizes, topic, partition),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
    first = spans[0].first
    kept = sum(s.stop - s.first for s in spans)
    return batch if first == 0 and kept == n else batch.slice(first, kept)


def _ends(sizes: Ints) -> pa.Buffer:
    """Arrow's int32 offsets for values of these sizes: 0, then the running total."""
    out = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=out[1:])
    if out[-1] > _INT32_MAX:
        raise ValueError(f"{out[-1]} bytes are too many for one Arrow binary array")
    return pa.py_buffer(out.astype(np.int32))


def _headers(blob: pa.Buffer, sizes: Ints, topic: str, partition: int) -> pa.Array:
    """The ``headers`` column: per record a list of (name, value) structs from its blob."""
    n = len(sizes)
    if blob.size > _INT32_MAX:
        raise ValueError(f"{blob.size} bytes of headers are too many for one Arrow array")
    ends = np.zeros(n + 1, np.int32)
    np.cumsum(sizes, out=ends[1:], dtype=np.int32)
    if ends[-1] == 0:
        return pa.ListArray.from_arrays(pa.array(ends), _NO_HEADERS, HEADERS_TYPE)
    bounds, counts = _header_bounds(blob, ends, topic, partition)
    parts = pa.Array.from_buffers(pa.binary(), len(bounds) - 1, [None, pa.py_buffer(bounds), blob])
    every = np.arange(0, len(bounds), 4, dtype=np.int32)
    names = pc.take(parts, every, boundscheck=False).cast(pa.string())
    values = pc.take(parts, every + 2, boundscheck=False)
    struct = pa.StructArray.from_arrays([names, values], fields=list(HEADER_TYPE))
    list_ends = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=list_ends[1:], dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(list_ends), struct, HEADERS_TYPE)


_NO_HEADERS = pa.StructArray.from_arrays(
    [pa.array([], pa.string()), pa.array([], pa.binary())], fields=list(HEADER_TYPE)
)

Step = tuple[Ints | None, Ints, Ints]  # records (None: all), header start, value length at


def _header_bounds(blob: pa.Buffer, ends: Ints, topic: str, partition: int) -> tuple[Ints, Ints]:
    """Per header, in blob order: where its name starts and ends and its value starts and ends,
    four int32 each (flat: Arrow offsets). Consecutive headers are adjacent in the blob, so the
    bounds never decrease; the element after a value is the next header's name length. Also how
    many headers each record has. Record ``r``'s headers fill ``[ends[r], ends[r + 1])``."""
    steps = _walk_headers(blob, ends, topic, partition)
    n = len(ends) - 1
    if all(records is None for records, *_ in steps):  # every record has len(steps) headers
        counts = np.full(n, len(steps), np.int32)
        starts = np.empty((len(steps), n), np.int32)  # a step per row, then blob order
        value_len_at = np.empty((len(steps), n), np.int32)
        for k, (_, at, length_at) in enumerate(steps):
            starts[k], value_len_at[k] = at, length_at
        starts, value_len_at = starts.T.ravel(), value_len_at.T.ravel()
    else:
        counts = np.zeros(n, np.int32)
        for records, *_ in steps:
            counts[slice(None) if records is None else records] += 1
        first = np.zeros(n, np.int32)
        np.cumsum(counts[:-1], out=first[1:], dtype=np.int32)
        starts = np.empty(int(counts.sum()), np.int32)
        value_len_at = np.empty(len(starts), np.int32)
        for k, (records, at, length_at) in enumerate(steps):
            slots = (first if records is None else first[records]) + k
            starts[slots], value_len_at[slots] = at, length_at
    bounds = np.empty((len(starts), 4), np.int32)
    bounds[:, 0] = starts + 2
    bounds[:, 1] = value_len_at
    bounds[:, 2] = value_len_at + 4
    bounds[:-1, 3] = starts[1:]  # a value ends where the next header starts
    bounds[-1, 3] = ends[-1]
    return bounds.ravel(), counts


def _walk_headers(blob: pa.Buffer, ends: Ints, topic: str, partition: int) -> list[Step]:
    """Step k: the k-th header of every record that has k or more (None: all), where each
    starts and where its value length is. Each record's headers must end exactly at its end."""
    size = blob.size
    # Unaligned little-endian views at every byte position: u16[p] is the u16 at byte p.
    u16 = np.ndarray((max(size - 1, 0),), "<u2", blob, 0, (1,))
    u32 = np.ndarray((max(size - 3, 0),), "<u4", blob, 0, (1,))
    ends = ends.astype(np.int64)  # no sum of lengths wraps around, so every step moves on
    stop = ends[1:]
    records: Ints | None = None
    pos = ends[:-1]
    if not (stop > pos).all():
        records = np.flatnonzero(stop > pos).astype(np.int32)
        pos, stop = pos[records], stop[records]
    steps: list[Step] = []
    try:
        while len(pos):
            value_len_at = pos + 2 + u16[pos]
            after = value_len_at + 4 + u32[value_len_at]
            steps.append((records, pos, value_len_at))
            more = after < stop
            if more.all():
                pos = after
                continue
            if (after[~more] != stop[~more]).any():
                raise _malformed(topic, partition)
            keep = np.flatnonzero(more)
            records = keep.astype(np.int32) if records is None else records[keep]
            pos, stop = after[keep], stop[keep]
    except IndexError:  # a header running past the blob
        raise _malformed(topic, partition) from None
    return steps


def _malformed(topic: str, partition: int) -> CorruptLog:
    return CorruptLog(f"malformed record headers in a batch of {topic}/{partition}")
