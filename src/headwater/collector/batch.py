"""A request's events straight to the embedded log's encoded batch body.

``encode_events`` gives, byte for byte, what ``format.encode(to_messages(events, ctx), now)``
gives (with the same event ids), after the checks ``validate_batch`` makes, without a
``Message`` or ``PackedHeaders`` per event: the columns and blobs are made in bulk.

A record's headers are those of ``to_messages``: type, content type, event id, then the
request's shared headers. Within a run of consecutive events of one (type, content type) they
differ only in the id, which is always 36 bytes, so a run's headers blob is one join of its ids
(``prefix + (shared + prefix).join(ids) + shared``) and its ``headers_len`` is one value.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import groupby
from typing import NamedTuple

from headwater.bus import context
from headwater.bus.embedded import format as fmt
from headwater.bus.headers import pack as pack_headers
from headwater.bus.headers import pack_header
from headwater.bus.records import Header, Message
from headwater.bus.validation import validate_batch
from headwater.collector.events import EventIn, RequestContext, to_messages, uuid7_batch

ID_SIZE = 36  # a UUID's canonical text


def unkeyed(events: Sequence[EventIn]) -> bool:
    """Whether no event has a partition key (what ``encode_events`` takes)."""
    return all(e.key is None for e in events)


class Prepared(NamedTuple):
    """A request's events checked for the log: their values, ids, and runs of one
    (type, content type) with their lengths."""

    values: tuple[bytes, ...]
    ids: Sequence[bytes]
    runs: list[tuple[tuple[str, str], int]]
    shared: tuple[Header, ...]


def prepare(
    events: Sequence[EventIn],
    ctx: RequestContext,
    max_record_bytes: int,
    topic: str,
    ids: Sequence[bytes] | None = None,
) -> Prepared:
    """Check ``events`` (none with a key) as ``validate_batch`` would check their messages,
    in bulk, and give them ids (``ids``, 36 bytes each, or new UUIDv7s).

    Raises ``InvalidArgument`` for a value that is not bytes, ``RecordTooLarge`` with its
    ``index`` and ``size`` (a record's size is the bus's: key + value + packed headers)."""
    n = len(events)
    if not n:
        raise ValueError("no events to encode")
    types, values, content_types, keys = zip(*events, strict=True)
    if keys.count(None) != n:
        raise ValueError("encode_events takes events without keys only (see unkeyed)")
    if ids is None:
        ids = uuid7_batch(n, ctx.received_ms)
    elif len(ids) != n or set(map(len, ids)) != {ID_SIZE}:
        raise ValueError(f"need {n} ids of {ID_SIZE} bytes each")
    if types.count(types[0]) == n and content_types.count(content_types[0]) == n:
        runs = [((types[0], content_types[0]), n)]
    else:
        runs = [
            (kind, len(list(group)))
            for kind, group in groupby(zip(types, content_types, strict=True))
        ]
    shared = ctx.shared_headers()
    shared_size = len(pack_headers(shared))
    largest_headers = max(len(_prefix(*kind)) for kind, _ in runs) + ID_SIZE + shared_size
    ts = ctx.received_ms
    if not (
        set(map(type, values)) == {bytes}
        and type(ts) is int
        and ts >= 0
        and max(map(len, values)) + largest_headers <= max_record_bytes
    ):  # a bound on every record's size failed: check them one by one, as the bus would
        validate_batch(topic, to_messages(events, ctx, ids=ids), max_record_bytes)
    return Prepared(values, ids, runs, shared)


def encode_events(
    events: Sequence[EventIn],
    ctx: RequestContext,
    max_record_bytes: int,
    topic: str,
    *,
    ids: Sequence[bytes] | None = None,
) -> fmt.EncodedBatch:
    """The encoded batch body of ``events`` (none with a key), stamped ``ctx.received_ms``,
    after ``prepare``'s checks."""
    values, ids, runs, shared_headers = prepare(events, ctx, max_record_bytes, topic, ids)
    n = len(values)
    shared = pack_headers(shared_headers)
    ts = ctx.received_ms
    blobs: list[bytes] = []
    lens: list[bytes] = []
    start = 0
    for (event_type, content_type), count in runs:
        prefix = _prefix(event_type, content_type)
        run = ids if count == n else ids[start : start + count]
        blobs.append(b"".join((prefix, (shared + prefix).join(run), shared)))
        lens.append(fmt.repeat_u32(len(prefix) + ID_SIZE + len(shared), count))
        start += count
    body = fmt.encode_body(
        fmt.contiguous_deltas(n),
        fmt.repeat_i64(ts, n),
        fmt.no_keys(n),
        fmt.lengths(values),
        lens[0] if len(lens) == 1 else b"".join(lens),
        (),
        values,
        blobs,
    )
    return fmt.EncodedBatch(body, fmt.crc32(body), n, n - 1, ts, ts)


class EmbeddedEncoding:
    """How the sinks that append to the embedded log encode (``collector.publisher.LogSink``):
    a request's unkeyed events as one batch body, keyed messages with ``format.encode``."""

    @staticmethod
    def encode_events(
        events: Sequence[EventIn], ctx: RequestContext, max_record_bytes: int, topic: str
    ) -> list[tuple[int | None, fmt.EncodedBatch]]:
        return [(None, encode_events(events, ctx, max_record_bytes, topic))]

    @staticmethod
    def encode_messages(messages: Sequence[Message], now_ms: int) -> fmt.EncodedBatch:
        return fmt.encode(messages, now_ms)

    @staticmethod
    def size(batch: fmt.EncodedBatch) -> int:
        return len(batch.body)

    async def finish(self) -> None:
        """Nothing to wait for: every append is answered as the log makes it durable, and the
        requests waiting on them are over when the collector stops."""


@lru_cache(maxsize=1024)
def _prefix(event_type: str, content_type: str) -> bytes:
    """The packed headers before a record's event id: type, content type, the id's name and
    length."""
    pairs = ((context.TYPE, event_type.encode()), (context.CONTENT_TYPE, content_type.encode()))
    return pack_headers(pairs) + pack_header(context.EVENT_ID, bytes(ID_SIZE))[:-ID_SIZE]
