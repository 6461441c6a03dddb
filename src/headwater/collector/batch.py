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

from headwater.bus import context
from headwater.bus.embedded import format as fmt
from headwater.bus.headers import pack as pack_headers
from headwater.bus.headers import pack_header
from headwater.bus.validation import validate_batch
from headwater.collector.events import EventIn, RequestContext, to_messages, uuid7_batch

ID_SIZE = 36  # a UUID's canonical text


def unkeyed(events: Sequence[EventIn]) -> bool:
    """Whether no event has a partition key (what ``encode_events`` takes)."""
    return all(e.key is None for e in events)


def encode_events(
    events: Sequence[EventIn],
    ctx: RequestContext,
    max_record_bytes: int,
    topic: str,
    *,
    ids: Sequence[bytes] | None = None,
) -> fmt.EncodedBatch:
    """The encoded batch body of ``events`` (none with a key), stamped ``ctx.received_ms``.

    Raises as ``validate_batch`` would for their messages (``InvalidArgument`` for a value
    that is not bytes, ``RecordTooLarge`` with its ``index`` and ``size``; ``topic`` is for
    the messages). ``ids`` are the event ids to use (36 bytes each); by default new UUIDv7s
    (``uuid7_batch``)."""
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
    shared = pack_headers(ctx.shared_headers())
    ts = ctx.received_ms
    blobs: list[bytes] = []
    lens: list[bytes] = []
    largest_headers = start = 0
    for (event_type, content_type), count in runs:
        prefix = _prefix(event_type, content_type)
        size = len(prefix) + ID_SIZE + len(shared)  # every record of the run
        largest_headers = max(largest_headers, size)
        run = ids if count == n else ids[start : start + count]
        blobs.append(b"".join((prefix, (shared + prefix).join(run), shared)))
        lens.append(fmt.repeat_u32(size, count))
        start += count
    if not (
        set(map(type, values)) == {bytes}
        and type(ts) is int
        and ts >= 0
        and max(map(len, values)) + largest_headers <= max_record_bytes
    ):  # a bound on every record's size failed: check them one by one, as the bus would
        validate_batch(topic, to_messages(events, ctx, ids=ids), max_record_bytes)
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


@lru_cache(maxsize=1024)
def _prefix(event_type: str, content_type: str) -> bytes:
    """The packed headers before a record's event id: type, content type, the id's name and
    length."""
    pairs = ((context.TYPE, event_type.encode()), (context.CONTENT_TYPE, content_type.encode()))
    return pack_headers(pairs) + pack_header(context.EVENT_ID, bytes(ID_SIZE))[:-ID_SIZE]
