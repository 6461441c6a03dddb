"""Pages of the failed store through its index (``FailedIndex``: pages, counts, one event by
id) and the store's own ``get`` and ``total``, on the embedded log."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from headwater.bus.errors import InvalidArgument
from headwater.config.model import HeadwaterConfig
from headwater.pipeline import failed_index
from headwater.pipeline.failed import FailedEvent, FailedStore, make_id
from headwater.pipeline.failed_index import FailedIndex, IndexPage

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


def walk(index: FailedIndex, limit: int, **filters: str) -> list[list[FailedEvent]]:
    """Every page, following the cursors to the end."""
    pages: list[list[FailedEvent]] = []
    before: str | None = None
    while True:
        page = index.page(**filters, before=before, limit=limit)
        pages.append(page.events)
        if page.next is None:
            return pages
        assert len(page.events) == limit
        before = page.next


def offsets(events: list[FailedEvent]) -> list[int]:
    return [e.offset for e in events]


def test_newest_first_with_a_cursor_to_the_next_page(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(5)])
    first = index.page(limit=2)
    assert offsets(first.events) == [4, 3]
    assert first.events[0] == event(4)
    assert first.matching == 5
    second = index.page(before=first.next, limit=2)
    assert offsets(second.events) == [2, 1]
    last = index.page(before=second.next, limit=2)
    assert last == IndexPage([event(0)], None, 5)
    assert index.page(limit=5).next is None  # exactly full: no next page


def test_an_empty_or_missing_store_has_one_empty_page(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    assert index.page() == IndexPage([], None, 0)
    assert store.get(event(0).id) is None
    assert store.total() == 0
    store.ensure_topic(store.topic)
    assert index.page() == IndexPage([], None, 0)
    assert index.count() == 0 and index.get(event(0).id) is None


def test_every_filter(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append(
        [
            event(0),
            event(1, destination="pg"),
            event(2, step="schema", code="HW-PIPE-102"),
            event(3, destination="pg", code="HW-PIPE-102"),
            event(4),
        ]
    )
    assert offsets(index.page(destination="pg").events) == [3, 1]
    assert offsets(index.page(destination="warehouse").events) == [4, 2, 0]
    assert offsets(index.page(step="schema").events) == [2]
    assert offsets(index.page(code="HW-PIPE-102").events) == [3, 2]
    assert offsets(index.page(destination="pg", code="HW-PIPE-102").events) == [3]
    assert offsets(index.page(since="2024-05-01T00:00:02").events) == [4, 3, 2]
    assert offsets(index.page(since="2024-05-01T00:00:02", code="HW-PIPE-101").events) == [4]
    assert index.page(destination="nope") == IndexPage([], None, 0)
    assert index.page(code="HW-PIPE-102").matching == 2
    assert index.count() == 5 and index.count(since="2024-05-01T00:00:02") == 3


def test_the_contract_filter_finds_the_events_a_contract_rejected(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    broke = "contract signup/1-0-0: /plan: 'gold' is not one of ['pro'] (enum)"
    store.append(
        [
            replace(event(0, step="contract", code="HW-PIPE-501"), reason=broke),
            event(1),
            replace(event(2, step="contract", code="HW-PIPE-501"), reason=broke),
            replace(
                event(3, step="contract", code="HW-PIPE-501"), reason="contract other/2-0-0: x"
            ),
            replace(event(4), reason="contract signup/1-0-0: not a contract step"),
        ]
    )
    assert offsets(index.page(contract="signup/1-0-0").events) == [2, 0]
    assert offsets(index.page(contract="other/2-0-0").events) == [3]
    assert index.page(contract="signup/1-0-0", destination="pg").matching == 0


def test_paging_walks_every_event_exactly_once(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i, destination="pg" if i % 3 else "warehouse") for i in range(100)])
    for limit in (1, 7, 10, 33, 100, 500):
        pages = walk(index, limit)
        assert [o for page in pages for o in offsets(page)] == list(range(99, -1, -1))
    filtered = [o for page in walk(index, 4, destination="warehouse") for o in offsets(page)]
    assert filtered == list(range(99, -1, -3))


def test_paging_merges_several_partitions_newest_first(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    with store.open(read_only=False) as bus:
        bus.create_topic(store.topic, partitions=3)  # Kafka's layout: records go by key
    store.append([event(i) for i in range(60)])
    with store.open(read_only=True) as bus:
        used = [bus.watermarks(store.topic, p)[1] for p in range(3)]
    assert all(used) and sum(used) == 60
    for limit in (1, 8, 60):
        pages = walk(index, limit)
        assert [o for page in pages for o in offsets(page)] == list(range(59, -1, -1))


def test_a_refailed_id_appears_once_with_its_latest_record_on_its_newest_page(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(10)])
    again = replace(event(2), code="HW-PIPE-103", failed_at="2024-05-01T01:00:00.000Z")
    store.append([again])  # a batch failed again after a crash: same id, newest position
    assert store.total() == 11
    pages = walk(index, 3)
    assert [offsets(p) for p in pages] == [[2, 9, 8], [7, 6, 5], [4, 3, 1], [0]]
    assert pages[0][0] == again
    # and with a filter the old record does not match in its place: the id is the latest record
    assert offsets(index.page(code="HW-PIPE-101").events) == [9, 8, 7, 6, 5, 4, 3, 1, 0]
    assert offsets(index.page(code="HW-PIPE-103").events) == [2]
    assert [e.id for e in store.events()] == [
        e.id for e in reversed([e for page in pages for e in page])
    ]


def test_an_id_failed_again_after_its_page_was_shown_does_not_come_back_lower(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(10)])
    first = index.page(limit=4)
    assert offsets(first.events) == [9, 8, 7, 6]
    later = "2024-05-01T01:00:00.000Z"  # failed again, later
    store.append(
        [
            replace(event(8), reason="again", failed_at=later),
            replace(event(3), reason="again", failed_at=later),
        ]
    )
    rest = [o for page in walk_from(index, first.next, 4) for o in offsets(page)]
    assert rest == [5, 4, 2, 1, 0]  # 8 is newer than the cursor now, 3 is above it too
    fresh = index.page(limit=3)
    assert offsets(fresh.events) == [3, 8, 9]
    assert fresh.events[0].reason == "again"


def walk_from(index: FailedIndex, before: str | None, limit: int) -> list[list[FailedEvent]]:
    pages: list[list[FailedEvent]] = []
    while before is not None:
        page = index.page(before=before, limit=limit)
        pages.append(page.events)
        before = page.next
    return pages


def test_a_refailed_id_far_above_its_first_record_is_shown_once_across_pages(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(10_000)])
    again = replace(event(5), reason="again", failed_at="2024-05-02T00:00:00.000Z")
    store.append([again])  # its old record is 9,995 records lower
    seen: list[str] = []
    for page in walk(index, 1000):
        seen += [e.id for e in page]
    assert len(seen) == len(set(seen)) == 10_000
    assert index.page(limit=1).events[0].reason == "again"


def test_the_index_reads_only_what_was_appended_since_its_last_look(config, monkeypatch):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(3_000)])
    assert index.count() == 3_000
    read: list[tuple[int, int]] = []
    real = failed_index.read_range

    def counting(bus, topic, partition, start, end):  # type: ignore[no-untyped-def]
        read.append((start, end))
        return real(bus, topic, partition, start, end)

    monkeypatch.setattr(failed_index, "read_range", counting)
    store.append([event(i) for i in range(3_000, 3_010)])
    page = index.page(since="2024-05-01T00:49:50", limit=50)  # offset 2,990 on
    assert offsets(page.events) == list(range(3_009, 2_989, -1))
    assert page.next is None and page.matching == 20
    assert read[0] == (3_000, 3_010)  # the refresh: only the new records
    assert all(end - start <= 50 for start, end in read[1:])  # then the page's own


def test_get_returns_the_latest_record_of_an_id(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(i) for i in range(20)])
    store.append([replace(event(4), reason="again")])
    for where in (store, index):
        assert where.get(event(7).id) == event(7)
        assert where.get(event(4).id) == replace(event(4), reason="again")
        assert where.get("warehouse:events-track:0:999") is None
    assert store.total() == 21


def test_a_cursor_that_is_not_one_is_refused(config):
    store = FailedStore(config)
    index = FailedIndex(store)
    store.append([event(0)])
    with pytest.raises(InvalidArgument, match="not a page cursor"):
        index.page(before="yesterday")
