"""A request's events straight to Kafka records, for headwater's own producer
(``headwater.bus.kafka.sender``): what ``collector.batch`` is to the embedded log.

The records are those ``to_messages`` would give (values as sent; headers type, content type,
event id, then the request's shared headers), checked by ``collector.batch.prepare``. Within a
run of one (type, content type) a record differs from the next only in its value, its offset
delta and its id, so a record is a join of ready pieces: its length and offset delta looked up
in the zigzag table, the run's header prefix, the id, the shared headers. They are joined when
the batch is made (``EventChunk.records``), when the offset deltas are known.

A request larger than ``MAX_CHUNK_BYTES`` is cut into chunks of about that size, so that each
fits a record batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import groupby, repeat
from operator import add

from headwater.bus import context
from headwater.bus.kafka.protocol.codec import ZIGZAG, ZIGZAG_TABLE_SIZE, varint
from headwater.bus.kafka.protocol.records import encode_header
from headwater.collector.batch import ID_SIZE, prepare
from headwater.collector.events import EventIn, RequestContext

MAX_CHUNK_BYTES = 512 * 1024
_NO_KEY = varint(-1)
_RECORD_FIXED = 1 + 1  # attributes, the null key's length
_VARINT_MAX = 5  # an int32 as a varint at its widest
_TABLE = ZIGZAG.__getitem__
_SHORT = ZIGZAG_TABLE_SIZE - 4096  # values shorter than this have their length in the table


class EventChunk:
    """Some of a request's events, as records for one partition (``sender.Chunk``)."""

    __slots__ = (
        "count",
        "first_timestamp",
        "ids",
        "last_timestamp",
        "runs",
        "shared",
        "size",
        "values",
    )

    def __init__(
        self,
        values: Sequence[bytes],
        ids: Sequence[bytes],
        runs: list[tuple[bytes, int]],
        shared: bytes,
        timestamp: int,
    ) -> None:
        self.values = values
        self.ids = ids
        self.runs = runs  # (the header prefix of a run, its length)
        self.shared = shared
        self.count = len(values)
        self.first_timestamp = self.last_timestamp = timestamp
        headers = max(len(prefix) for prefix, _ in runs) + ID_SIZE + len(shared)
        each = _RECORD_FIXED + 10 + 2 * _VARINT_MAX + _VARINT_MAX + headers
        self.size = sum(map(len, values)) + self.count * each

    def records(self, first_delta: int, base_timestamp: int) -> bytes:
        n = self.count
        ts = varint(self.first_timestamp - base_timestamp)
        value_lens = list(map(len, self.values))
        if first_delta + n <= ZIGZAG_TABLE_SIZE and max(value_lens) < _SHORT:
            deltas = ZIGZAG[first_delta : first_delta + n]
            vl = list(map(_TABLE, value_lens))
        else:  # a record of 60 kB or more, or offsets past the table
            deltas = [varint(d) for d in range(first_delta, first_delta + n)]
            vl = list(map(varint, value_lens))
        # a record's length: its fixed part, its offset delta's and value length's varints,
        # its value (every field but these is the same for the records of a run)
        sizes = list(map(add, map(add, map(len, deltas), map(len, vl)), value_lens))
        head = b"\x00" + ts  # attributes, timestamp delta
        if len(self.runs) == 1:
            return b"".join(
                self._run(self.runs[0][0], ts, head, sizes, deltas, vl, self.values, self.ids)
            )
        out: list[bytes] = []
        start = 0
        for prefix, count in self.runs:
            end = start + count
            out += self._run(
                prefix,
                ts,
                head,
                sizes[start:end],
                deltas[start:end],
                vl[start:end],
                self.values[start:end],
                self.ids[start:end],
            )
            start = end
        return b"".join(out)

    def _run(
        self,
        prefix: bytes,
        ts: bytes,
        head: bytes,
        sizes: list[int],
        deltas: Sequence[bytes],
        vl: Sequence[bytes],
        values: Sequence[bytes],
        ids: Sequence[bytes],
    ) -> list[bytes]:
        """The pieces of a run's records, in order."""
        count = len(values)
        fixed = _RECORD_FIXED + len(ts) + len(prefix) + ID_SIZE + len(self.shared)
        lengths = list(map(add, sizes, repeat(fixed, count)))
        pieces: list[bytes] = [b""] * (9 * count)
        pieces[0::9] = list(map(_TABLE if max(lengths) < ZIGZAG_TABLE_SIZE else varint, lengths))
        pieces[1::9] = [head] * count
        pieces[2::9] = deltas
        pieces[3::9] = [_NO_KEY] * count
        pieces[4::9] = vl
        pieces[5::9] = values
        pieces[6::9] = [prefix] * count
        pieces[7::9] = ids
        pieces[8::9] = [self.shared] * count
        return pieces


def event_chunks(
    events: Sequence[EventIn], ctx: RequestContext, max_record_bytes: int, topic: str
) -> list[EventChunk]:
    """``events`` (none with a key) as chunks of at most about ``MAX_CHUNK_BYTES``, after
    ``collector.batch.prepare``'s checks (``RecordTooLarge``, ``InvalidArgument``)."""
    values, ids, runs, shared_headers = prepare(events, ctx, max_record_bytes, topic)
    shared = b"".join([encode_header(n, v) for n, v in shared_headers])
    nheaders = 3 + len(shared_headers)
    prefixes = [(_prefix(t, ct, nheaders), count) for (t, ct), count in runs]
    chunk = EventChunk(values, ids, prefixes, shared, ctx.received_ms)
    if chunk.size <= MAX_CHUNK_BYTES or chunk.count == 1:
        return [chunk]
    out = []
    per_event = chunk.size / chunk.count
    step = max(1, int(MAX_CHUNK_BYTES / per_event))
    flat = [prefix for prefix, count in prefixes for _ in range(count)]
    for start in range(0, chunk.count, step):
        part = flat[start : start + step]
        part_runs = [(prefix, len(list(group))) for prefix, group in groupby(part)]
        out.append(
            EventChunk(
                values[start : start + step],
                ids[start : start + step],
                part_runs,
                shared,
                ctx.received_ms,
            )
        )
    return out


@lru_cache(maxsize=1024)
def _prefix(event_type: str, content_type: str, nheaders: int) -> bytes:
    """A record's header count, its type and content-type headers, and the event id's name
    and length (the id follows)."""
    return b"".join(
        (
            varint(nheaders),
            encode_header(context.TYPE, event_type.encode()),
            encode_header(context.CONTENT_TYPE, content_type.encode()),
            encode_header(context.EVENT_ID, bytes(ID_SIZE))[:-ID_SIZE],
        )
    )
