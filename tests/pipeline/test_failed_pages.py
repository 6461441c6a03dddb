"""Pages of the failed store (``FailedStore.page``, ``get``, ``total``), on the embedded log."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.errors import InvalidArgument
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.failed import FailedEvent, FailedPage, FailedStore, make_id

START = datetime(2024, 5, 1, tzinfo=UTC)


def event(
    offset: int,
    destination: str = "warehouse",
    step: str = "decode",
    code: str = "HW-PIPE-101",
) -> FailedEvent:
    """A failed event whose ``failed_at`` grows with ``offset`` (one second apart)."""
    failed_at = START + timedelta(seconds=offset)
    return FailedEvent(
        id=make_id(destination, "events-track", 0, offset),
        destination=destination,
        step=step,
        code=code,
        reason="the value is not valid JSON",
        topic="events-track",
        partition=0,
        offset=offset,
        failed_at=failed_at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        key=None,
        value=b'{"bad": %d' % offset,
        headers=(("type", b"track"),),
    )


@pytest.fixture
def config(tmp_path: Path) -> HeadwaterConfig:
    return HeadwaterConfig.model_validate(
        {
            "data_dir": tmp_path / "data",
            "pipeline": {"destinations": [{"id": "warehouse", "type": "duckdb"}]},
        }
    )


def walk(store: FailedStore, limit: int, **filters: str) -> list[list[FailedEvent]]:
    """Every page, following the cursors to the end."""
    pages: list[list[FailedEvent]] = []
    before: str | None = None
    while True:
        page = store.page(**filters, before=before, limit=limit)
        pages.append(page.events)
        if page.next is None:
            return pages
        assert len(page.events) == limit
        before = page.next


def offsets(events: list[FailedEvent]) -> list[int]:
    return [e.offset for e in events]


def test_newest_first_with_a_cursor_to_the_next_page(config):
    store = FailedStore(config)
    store.append([event(i) for i in range(5)])
    first = store.page(limit=2)
    assert offsets(first.events) == [4, 3]
    assert first.events[0] == event(4)
    assert first.next == "0:3"
    second = store.page(before=first.next, limit=2)
    assert offsets(second.events) == [2, 1]
    last = store.page(before=second.next, limit=2)
    assert last == FailedPage([event(0)], None)
    assert store.page(limit=5).next is None  # exactly full: no next page


def test_an_empty_or_missing_store_has_one_empty_page(config):
    store = FailedStore(config)
    assert store.page() == FailedPage([], None)
    assert store.get(event(0).id) is None
    assert store.total() == 0
    store.ensure_topic(store.topic)
    assert store.page() == FailedPage([], None)


def test_every_filter(config):
    store = FailedStore(config)
    store.append(
        [
            event(0),
            event(1, destination="pg"),
            event(2, step="schema", code="HW-PIPE-102"),
            event(3, destination="pg", code="HW-PIPE-102"),
            event(4),
        ]
    )
    assert offsets(store.page(destination="pg").events) == [3, 1]
    assert offsets(store.page(destination="warehouse").events) == [4, 2, 0]
    assert offsets(store.page(step="schema").events) == [2]
    assert offsets(store.page(code="HW-PIPE-102").events) == [3, 2]
    assert offsets(store.page(destination="pg", code="HW-PIPE-102").events) == [3]
    assert offsets(store.page(since="2024-05-01T00:00:02").events) == [4, 3, 2]
    assert offsets(store.page(since="2024-05-01T00:00:02", code="HW-PIPE-101").events) == [4]
    assert store.page(destination="nope") == FailedPage([], None)


def test_paging_walks_every_event_exactly_once(config):
    store = FailedStore(config)
    store.append([event(i, destination="pg" if i % 3 else "warehouse") for i in range(100)])
    for limit in (1, 7, 10, 33, 100, 500):
        pages = walk(store, limit)
        assert [o for page in pages for o in offsets(page)] == list(range(99, -1, -1))
    filtered = [o for page in walk(store, 4, destination="warehouse") for o in offsets(page)]
    assert filtered == list(range(99, -1, -3))


def test_paging_merges_several_partitions_newest_first(config):
    store = FailedStore(config)
    with store._open(read_only=False) as bus:
        bus.create_topic(store.topic, partitions=3)  # Kafka's layout: records go by key
    store.append([event(i) for i in range(60)])
    with store._open(read_only=True) as bus:
        used = [bus.watermarks(store.topic, p)[1] for p in range(3)]
    assert all(used) and sum(used) == 60
    for limit in (1, 8, 60):
        pages = walk(store, limit)
        assert [o for page in pages for o in offsets(page)] == list(range(59, -1, -1))
    assert len(store.page(limit=8).next.split(",")) == 3


def test_a_refailed_id_appears_once_with_its_latest_record_on_its_newest_page(config):
    store = FailedStore(config)
    store.append([event(i) for i in range(10)])
    again = replace(event(2), code="HW-PIPE-103", failed_at="2024-05-01T01:00:00.000Z")
    store.append([again])  # a batch failed again after a crash: same id, newest position
    assert store.total() == 11
    pages = walk(store, 3)
    assert [offsets(p) for p in pages] == [[2, 9, 8], [7, 6, 5], [4, 3, 1], [0]]
    assert pages[0][0] == again
    # and with a filter the old record does not match in its place: the id is the latest record
    assert offsets(store.page(code="HW-PIPE-101").events) == [9, 8, 7, 6, 5, 4, 3, 1, 0]
    assert offsets(store.page(code="HW-PIPE-103").events) == [2]
    assert [e.id for e in store.events()] == [
        e.id for e in reversed([e for page in pages for e in page])
    ]


def test_an_id_failed_again_after_its_page_was_shown_does_not_come_back_lower(config):
    store = FailedStore(config)
    store.append([event(i) for i in range(10)])
    first = store.page(limit=4)
    assert offsets(first.events) == [9, 8, 7, 6]
    store.append([replace(event(8), reason="again"), replace(event(3), reason="again")])
    rest = [o for page in walk_from(store, first.next, 4) for o in offsets(page)]
    assert rest == [5, 4, 2, 1, 0]  # 8 is newer than the cursor now, 3 is above it too
    fresh = store.page(limit=3)
    assert offsets(fresh.events) == [3, 8, 9]
    assert fresh.events[0].reason == "again"


def walk_from(store: FailedStore, before: str | None, limit: int) -> list[list[FailedEvent]]:
    pages: list[list[FailedEvent]] = []
    while before is not None:
        page = store.page(before=before, limit=limit)
        pages.append(page.events)
        before = page.next
    return pages


def test_a_refailed_id_far_above_its_first_record_is_shown_once_across_pages(config):
    store = FailedStore(config)
    store.append([event(i) for i in range(10_000)])
    store.append([replace(event(5), reason="again")])  # its old record is 9,995 records lower
    seen: list[str] = []
    for page in walk(store, 1000):
        seen += [e.id for e in page]
    assert len(seen) == len(set(seen)) == 10_000
    assert store.page(limit=1).events[0].reason == "again"


def test_since_stops_reading_at_the_first_older_record(config, monkeypatch):
    store = FailedStore(config)
    store.append([event(i) for i in range(30_000)])
    read: list[int] = []
    real = EmbeddedBus.read_arrow

    def counting(self: EmbeddedBus, *args: Any, **kwargs: Any) -> list[pa.RecordBatch]:
        batches = real(self, *args, **kwargs)
        read.append(sum(b.num_rows for b in batches))
        return batches

    monkeypatch.setattr(EmbeddedBus, "read_arrow", counting)
    page = store.page(since="2024-05-01T08:19:50", limit=50)  # offset 29,990 on
    assert offsets(page.events) == list(range(29_999, 29_989, -1))
    assert page.next is None
    assert 0 < sum(read) < 10_000  # not the 30,000 records of the store


def test_get_returns_the_latest_record_of_an_id(config):
    store = FailedStore(config)
    store.append([event(i) for i in range(20)])
    store.append([replace(event(4), reason="again")])
    assert store.get(event(7).id) == event(7)
    assert store.get(event(4).id) == replace(event(4), reason="again")
    assert store.get("warehouse:events-track:0:999") is None
    assert store.total() == 21


def test_a_cursor_that_is_not_one_is_refused(config):
    store = FailedStore(config)
    store.append([event(0)])
    with pytest.raises(InvalidArgument, match="not a failed-store page cursor"):
        store.page(before="yesterday")
    with pytest.raises(InvalidArgument, match="limit"):
        store.page(limit=0)


def test_a_page_of_100k_failed_events(config):
    store = FailedStore(config)
    events = [
        event(i, destination="pg" if i % 10 == 0 else "warehouse", code=f"HW-PIPE-10{i % 4}")
        for i in range(100_000)
    ]
    store.append(events)  # one append: one stored batch of 100k records, the worst layout
    assert store.total() == 100_000
    timings: dict[str, float] = {}
    started = time.perf_counter()
    store.page(limit=1)  # the first read of a process imports pyarrow and numpy
    timings["first (cold)"] = time.perf_counter() - started
    for name, filters in {
        "newest": {},
        "destination=pg": {"destination": "pg"},
        "destination=pg code=HW-PIPE-102": {"destination": "pg", "code": "HW-PIPE-102"},
    }.items():
        started = time.perf_counter()
        page = store.page(**filters)
        timings[name] = time.perf_counter() - started
        assert len(page.events) == 50 and page.next is not None
    started = time.perf_counter()
    deep = store.page(before="0:50000")
    timings["before=0:50000"] = time.perf_counter() - started
    assert offsets(deep.events) == list(range(49_999, 49_949, -1))
    started = time.perf_counter()
    assert store.get(events[99_990].id) == events[99_990]
    timings["get"] = time.perf_counter() - started
    print(" ".join(f"{name}: {seconds * 1000:.0f} ms" for name, seconds in timings.items()))
