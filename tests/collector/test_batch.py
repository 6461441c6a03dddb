"""The collector's direct path from a request's events to the log's encoded batch body: the
same bytes as ``format.encode(to_messages(...))``, the same errors as ``validate_batch``, and
the UUIDv7s it stamps."""

from __future__ import annotations

import re
import uuid

import pytest

from headwater.bus import context
from headwater.bus.embedded import format as fmt
from headwater.bus.errors import InvalidArgument, RecordTooLarge
from headwater.bus.validation import validate_batch
from headwater.collector.batch import encode_events, unkeyed
from headwater.collector.events import EventIn, RequestContext, Uuid7, to_messages, uuid7_batch

MS = 1_700_000_000_123
CTX = RequestContext("raccoon-ws", "raccoon", "req-1", MS, "10.0.0.7", "ua/1")
BARE = RequestContext("segment", "web", "r", MS)  # no client ip nor user agent
UUID7 = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def _old(events: list[EventIn], ctx: RequestContext, ids: list[bytes]) -> fmt.EncodedBatch:
    # another "now": the records' own timestamp (received_ms) is what goes in the column
    return fmt.encode(to_messages(events, ctx, ids=ids), MS + 999)


def _decode(batch: fmt.EncodedBatch, base: int = 7) -> list:
    framed = fmt.frame(batch, base)
    header = fmt.parse_header(framed, 0, len(framed))
    fmt.check_crc(framed, 0, header)
    return fmt.decode_records("t", 0, framed, 0, header)


def _events(types: list[str], content_types: list[str] | None = None) -> list[EventIn]:
    cts = content_types or ["application/json"] * len(types)
    return [
        EventIn(t, f'{{"n":{i},"pad":"{"x" * (i % 13)}"}}'.encode(), ct)
        for i, (t, ct) in enumerate(zip(types, cts, strict=True))
    ]


CASES = {
    "one event": (_events(["viewed"]), CTX),
    "1000 of one type": (_events(["viewed"] * 1000), CTX),
    "types interleaved": (_events(["a", "a", "bb", "a", "ccc", "ccc", "ccc", "a", "bb"]), CTX),
    "content types": (
        _events(["a"] * 4 + ["b"], ["x/pb", "x/pb", "application/json", "x/pb", "x/pb"]),
        CTX,
    ),
    "no ip nor agent": (_events(["a", "b", "b"]), BARE),
    "agent only": (_events(["a"] * 3), RequestContext("otlp", "s", "r", MS, user_agent="u")),
    "non-ascii type": (_events(["vïewed", "ゆ", "ゆ"]), CTX),
    "empty value": ([EventIn("a", b"", "x"), EventIn("a", b"1", "x")], CTX),
    "1000 in runs": (_events([f"type-{i // 7 % 5}" for i in range(1000)]), BARE),
}


@pytest.mark.parametrize("case", CASES)
def test_same_bytes_as_encoding_the_messages(case: str) -> None:
    events, ctx = CASES[case]
    ids = uuid7_batch(len(events), ctx.received_ms)
    new = encode_events(events, ctx, 1 << 20, "t", ids=ids)
    assert new == _old(events, ctx, ids)
    assert new.count == len(events) and new.last_offset_delta == len(events) - 1
    assert new.first_timestamp == new.max_timestamp == ctx.received_ms
    records = _decode(new)
    messages = to_messages(events, ctx, ids=ids)
    assert [r.offset for r in records] == list(range(7, 7 + len(events)))
    assert [r.value for r in records] == [e.value for e in events]
    assert {r.key for r in records} == {None} and {r.timestamp for r in records} == {MS}
    assert [r.headers for r in records] == [tuple(m.headers) for m in messages]
    for r, e, eid in zip(records, events, ids, strict=True):
        h = dict(r.headers)
        assert h[context.TYPE] == e.type.encode() and h[context.EVENT_ID] == eid
        assert h[context.CONTENT_TYPE] == e.content_type.encode()
        assert h[context.REQUEST_ID] == ctx.request_id.encode()
        assert (context.CLIENT_IP in h) == bool(ctx.client_ip)


def test_new_ids_by_default() -> None:
    events = _events(["a", "b"] * 50)
    records = _decode(encode_events(events, CTX, 1 << 20, "t"))
    ids = [dict(r.headers)[context.EVENT_ID] for r in records]
    assert all(UUID7.fullmatch(i) for i in ids) and len(set(ids)) == 100 and ids == sorted(ids)
    # no earlier than the request (ids are monotonic per process: another test's may be later)
    assert min(uuid.UUID(i.decode()).int >> 80 for i in ids) >= MS


def _errors(events: list[EventIn], limit: int) -> tuple[BaseException, BaseException]:
    """What encode_events raises, and what validate_batch raises for the same messages."""
    ids = uuid7_batch(len(events), MS)
    with pytest.raises((RecordTooLarge, InvalidArgument)) as new:
        encode_events(events, CTX, limit, "topic-a", ids=ids)
    with pytest.raises((RecordTooLarge, InvalidArgument)) as old:
        validate_batch("topic-a", to_messages(events, CTX, ids=ids), limit)
    return new.value, old.value


def test_too_large_is_the_first_record_over_the_limit_with_its_size() -> None:
    events = _events(["a"] * 3 + ["longer-type"] * 3)
    events[4] = events[4]._replace(value=b"v" * 300)
    events[5] = events[5]._replace(value=b"v" * 400)
    events[1] = events[1]._replace(value=b"v" * 250)
    headers = to_messages(events[4:5], CTX)[0].headers.size
    new, old = _errors(events, 300 + headers - 1)
    assert isinstance(new, RecordTooLarge) and type(new) is type(old)
    assert (new.index, new.size, str(new)) == (old.index, old.size, str(old))
    assert new.index == 4 and new.size == 300 + headers


def test_the_bound_on_sizes_is_only_a_bound() -> None:
    # the largest value and the largest headers are in different records, none over the limit
    events = [EventIn("a", b"v" * 500, "x"), EventIn("a-much-longer-type", b"v", "x")]
    ids = uuid7_batch(2, MS)
    messages = to_messages(events, CTX, ids=ids)
    limit = max(len(m.value) + m.headers.size for m in messages)
    assert limit < 500 + max(m.headers.size for m in messages)
    assert encode_events(events, CTX, limit, "t", ids=ids) == _old(events, CTX, ids)
    new, old = _errors(events, limit - 1)
    assert (
        (new.index, new.size, str(new)) == (old.index, old.size, str(old)) == (0, limit, str(old))
    )


@pytest.mark.parametrize("value", ["text", bytearray(b"ba"), None, memoryview(b"m")])
def test_a_value_that_is_not_bytes_is_named(value: object) -> None:
    events = _events(["a"] * 4)
    events[2] = events[2]._replace(value=value)
    new, old = _errors(events, 1 << 20)
    assert isinstance(new, InvalidArgument) and str(new) == str(old)
    assert "record 2 of the batch for 'topic-a': value must be bytes" in str(new)


def test_the_first_bad_record_wins_whatever_its_fault() -> None:
    events = _events(["a"] * 4)
    events[1] = events[1]._replace(value=b"v" * 5000)
    events[3] = events[3]._replace(value="text")
    new, old = _errors(events, 1000)
    assert isinstance(new, RecordTooLarge) and (new.index, str(new)) == (old.index, str(old))


def test_what_it_does_not_take() -> None:
    keyed = [EventIn("a", b"1", "x"), EventIn("a", b"2", "x", key=b"k")]
    assert not unkeyed(keyed) and unkeyed(keyed[:1])
    with pytest.raises(ValueError, match="without keys"):
        encode_events(keyed, CTX, 1000, "t")
    with pytest.raises(ValueError, match="no events"):
        encode_events([], CTX, 1000, "t")
    with pytest.raises(ValueError, match="ids"):
        encode_events(keyed[:1], CTX, 1000, "t", ids=[b"short"])
    with pytest.raises(ValueError, match="ids"):
        encode_events(keyed[:1], CTX, 1000, "t", ids=uuid7_batch(2))


def _parts(ids: list[bytes]) -> list[tuple[int, int]]:
    """(millisecond, counter) of each id."""
    return [(u.int >> 80, (u.int >> 64) & 0xFFF) for u in (uuid.UUID(i.decode()) for i in ids)]


def test_uuid7_format() -> None:
    ids = Uuid7().batch(5000, MS)
    assert all(len(i) == 36 and UUID7.fullmatch(i) for i in ids)
    parsed = [uuid.UUID(i.decode()) for i in ids]
    assert {u.version for u in parsed} == {7} and {u.variant for u in parsed} == {uuid.RFC_4122}
    assert [str(u).encode() for u in parsed] == ids
    low = [u.int & ((1 << 48) - 1) for u in parsed]
    assert len(set(low[:4096])) == 4096  # random bits that differ from one id to the next


def test_uuid7_monotonic_within_a_millisecond_and_across_counter_overflow() -> None:
    g = Uuid7()
    ids = [i for _ in range(3) for i in g.batch(10, MS)]  # several calls in one millisecond
    ids += g.batch(4096 + 4096 + 5, MS)  # the counter carries twice into the millisecond
    ids += g.batch(3, MS)  # still ahead of the clock: goes on from there
    ids += g.batch(2, MS + 1)  # the clock is behind the counter's millisecond: goes on too
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    steps = [ms * 4096 + c for ms, c in _parts(ids)]
    assert steps == list(range(steps[0], steps[0] + len(ids)))  # one counter step per id
    assert _parts(ids)[0] == (MS, steps[0] - MS * 4096) and steps[0] - MS * 4096 < 256
    assert _parts(ids)[-1][0] == MS + 2
    later = g.batch(1, MS + 100)  # a new millisecond restarts the counter below 256
    assert later[0] > ids[-1] and _parts(later)[0][0] == MS + 100 and _parts(later)[0][1] < 256


def test_uuid7_batches_of_one_and_none() -> None:
    g = Uuid7()
    assert g.batch(0, MS) == []
    ids = [g.batch(1, MS)[0] for _ in range(5000)]
    assert ids == sorted(ids) and len(set(ids)) == 5000
    assert {ms for ms, _ in _parts(ids)} == {MS, MS + 1}
