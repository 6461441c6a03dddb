"""The webhook state contract, run over both backends (embedded SQLite and Redis): dedup on
arrival, the status machine with its timestamped history, attempts kept in order, schedules
claimed once, a rate limit shared by every worker, and several processes' worth of workers on
one store."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from headwater.webhooks.state import (
    Attempt,
    InvalidTransition,
    StateStore,
    Status,
    UnknownMessage,
)
from headwater.webhooks.state.base import (
    CALLBACK,
    DELIVER,
    POLL,
    Claim,
    Cursor,
    MessageState,
    ReceiverState,
    cursor,
)
from headwater.webhooks.state.redis import RedisState
from headwater.webhooks.state.sqlite import SqliteState


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[type]:
    """Opens stores of the test's backend on the same data (as another process would)."""
    opened: list[StateStore] = []
    prefix = f"test:{uuid.uuid4().hex[:10]}:"

    def open_() -> StateStore:
        if request.param == "sqlite":
            store: StateStore = SqliteState(tmp_path / "webhooks.sqlite")
        else:
            service = request.getfixturevalue("redis_service")
            store = RedisState(service.url, prefix=prefix)
        opened.append(store)
        return store

    yield open_  # type: ignore[misc]
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store) -> StateStore:
    return open_store()


def test_arrival_dedups_on_source_and_message_id(store: StateStore) -> None:
    created, first = store.arrive("github", "m1", "ci", b'{"a": 1}', 100.0)
    assert created and first.status is Status.ARRIVED and first.payload == b'{"a": 1}'
    again, existing = store.arrive("github", "m1", "other", b'{"a": 2}', 101.0)
    assert not again
    assert existing.receiver == "ci" and existing.payload == b'{"a": 1}'
    assert existing.created_at == 100.0
    other_source, _ = store.arrive("gitlab", "m1", "ci", b"{}", 102.0)
    assert other_source
    assert store.get("github", "nope") is None
    assert store.known("github", "m1") and not store.known("github", "nope")


def test_the_intakes_lookup_on_a_loop_finds_only_recorded_messages(store: StateStore) -> None:
    async def lookups() -> tuple[MessageState | None, MessageState | None]:
        state = store.on_loop()
        try:
            return await state.lookup("github", "nope"), await state.lookup("github", "m1")
        finally:
            await state.close()

    store.arrive("github", "m1", "ci", b'{"a": 1}', 100.0)
    missing, found = asyncio.run(lookups())
    assert missing is None
    assert found is not None and found.key == ("github", "m1")
    assert found.status is Status.ARRIVED and found.receiver == "ci" and found.reason == ""


def test_a_batch_of_arrivals_is_recorded_as_one_at_a_time_would_be(store: StateStore) -> None:
    """In order, each answered for; a message twice in the batch (two collectors took it) is
    recorded once; batches larger than a script's (Redis: ARRIVE_BATCH messages, or payloads
    past ARRIVE_BATCH_BYTES) are all recorded."""
    store.arrive("s", "old", "ci", b'{"kept": 1}', 1.0)
    big = b'"' + b"x" * (700 << 10) + b'"'
    batch = [("s", f"m{i}", "ci" if i % 3 else "cd", b"{}") for i in range(250)]
    batch[10:10] = [("s", "old", "cd", b"{}"), ("s", "m5", "other", b"{}")]
    batch += [("s", "big1", "ci", big), ("s", "big2", "ci", big), ("s", "big1", "ci", b"{}")]
    answers = store.arrive_many(batch, 2.0)
    assert [(m.source_id, m.message_id) for _, m in answers] == [m[:2] for m in batch]
    created = [c for c, _ in answers]
    assert created.count(True) == 252  # 250, big1, big2
    old = answers[10][1]
    assert not created[10] and old.payload == b'{"kept": 1}' and old.created_at == 1.0
    again = answers[11][1]  # m5 recorded earlier in the batch: as recorded
    assert not created[11] and again.receiver == "ci" and again.status is Status.ARRIVED
    assert not created[-1] and answers[-1][1].payload == big
    assert store.get("s", "m249") is not None and store.get("s", "big2") is not None
    counts = store.counts()
    assert counts["ci"]["ARRIVED"] == 166 + 1 + 2 and counts["cd"]["ARRIVED"] == 84


def test_the_status_machine_and_its_history(store: StateStore) -> None:
    store.arrive("s", "m", "r", b"{}", 1.0)
    store.advance("s", "m", Status.DELIVERED_TO_RECEIVER, 2.0)
    store.advance("s", "m", Status.RESPONSE_RECEIVED_FROM_RECEIVER, 3.0, response=b'{"ok": 1}')
    done = store.advance("s", "m", Status.DONE, 4.0)
    assert done.status is Status.DONE and done.response == b'{"ok": 1}'
    assert [(t.status, t.at) for t in done.history] == [
        (Status.ARRIVED, 1.0),
        (Status.DELIVERED_TO_RECEIVER, 2.0),
        (Status.RESPONSE_RECEIVED_FROM_RECEIVER, 3.0),
        (Status.DONE, 4.0),
    ]
    with pytest.raises(InvalidTransition) as refused:
        store.advance("s", "m", Status.FAILED, 5.0, reason="late")
    assert refused.value.current is Status.DONE
    with pytest.raises(UnknownMessage):
        store.advance("s", "missing", Status.DELIVERED_TO_RECEIVER, 5.0)


def test_no_skipping_and_failed_keeps_its_reason(store: StateStore) -> None:
    store.arrive("s", "m", "r", b"{}", 1.0)
    with pytest.raises(InvalidTransition):
        store.advance("s", "m", Status.DONE, 2.0)
    failed = store.advance("s", "m", Status.FAILED, 3.0, reason="receiver answered 400")
    assert failed.status is Status.FAILED and failed.reason == "receiver answered 400"
    assert failed.history[-1].reason == "receiver answered 400"
    with pytest.raises(InvalidTransition):
        store.advance("s", "m", Status.DELIVERED_TO_RECEIVER, 4.0)


def test_attempts_are_kept_in_order(store: StateStore) -> None:
    store.arrive("s", "m", "r", b"{}", 1.0)
    first = Attempt(2.0, "deliver", 503, 12.5, "busy", "")
    second = Attempt(7.0, "deliver", None, 15000.0, "", "timed out after 15 s")
    store.record_attempt("s", "m", first)
    store.record_attempt("s", "m", second)
    state = store.get("s", "m")
    assert state is not None
    assert state.attempts == (first, second)
    assert state.tries("deliver") == 2 and state.tries("poll") == 0
    with pytest.raises(UnknownMessage):
        store.record_attempt("s", "missing", first)


def test_a_schedule_is_claimed_once_earliest_first(open_store) -> None:
    a, b = open_store(), open_store()
    a.schedule("retry", "s", "late", 50.0)
    a.schedule("retry", "s", "early", 10.0)
    a.schedule("retry", "s", "moved", 5.0)
    a.schedule("retry", "s", "moved", 500.0)  # scheduling again moves it
    a.schedule("poll", "s", "other-kind", 1.0)
    assert a.take_due("retry", 9.0, 10) == []
    assert b.take_due("retry", 60.0, 1) == [("s", "early")]
    assert a.take_due("retry", 60.0, 10) == [("s", "late")]
    assert b.take_due("retry", 60.0, 10) == []
    assert a.take_due("retry", 600.0, 10) == [("s", "moved")]
    assert b.take_due("poll", 600.0, 10) == [("s", "other-kind")]


def test_claims_by_concurrent_workers_never_overlap(open_store) -> None:
    stores = [open_store() for _ in range(3)]
    for i in range(300):
        stores[0].schedule("retry", "s", f"m{i}", float(i))
    claimed: list[list[tuple[str, str]]] = [[] for _ in stores]

    def worker(k: int) -> None:
        while batch := stores[k].take_due("retry", 1000.0, 7):
            claimed[k].extend(batch)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [m for c in claimed for m in c]
    assert sorted(every) == sorted(("s", f"m{i}") for i in range(300))
    assert len(every) == len(set(every))


def test_the_rate_limit_is_shared_and_evenly_spaced(open_store) -> None:
    stores = [open_store() for _ in range(3)]
    receiver = f"ci-{uuid.uuid4().hex[:6]}"
    granted: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 1.0

    def worker(k: int) -> None:
        while time.monotonic() < deadline:
            wait = stores[k].acquire(receiver, 50, 1.0)  # 50 per second
            if wait == 0:
                with lock:
                    granted.append(time.monotonic())
            else:
                assert 0 < wait <= 0.02 + 1e-3
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # one second at 50/s, spaced 20 ms apart: 50, +1 for the window's edge
    assert 45 <= len(granted) <= 51, len(granted)


def test_a_leased_claim_comes_back_unless_released(open_store) -> None:
    a, b = open_store(), open_store()
    a.schedule("deliver", "s", "kept", 1.0)
    a.schedule("deliver", "s", "died", 2.0)
    a.schedule("deliver", "s", "again", 3.0)
    assert a.take_due("deliver", 10.0, 10, lease_s=30.0) == [
        ("s", "kept"),
        ("s", "died"),
        ("s", "again"),
    ]
    assert b.take_due("deliver", 39.0, 10, lease_s=30.0) == []  # leased to a until 40
    a.release("deliver", "s", "kept", 40.0)  # its step is over
    a.schedule("deliver", "s", "again", 100.0)  # its step scheduled it again
    a.release("deliver", "s", "again", 40.0)  # so the release leaves it be
    # "died" was never released (its claimant died): it comes due again after the lease
    assert b.take_due("deliver", 41.0, 10, lease_s=30.0) == [("s", "died")]
    b.release("deliver", "s", "died", 71.0)
    assert b.take_due("deliver", 101.0, 10) == [("s", "again")]


def test_a_send_is_claimed_by_one_worker_and_an_unanswered_one_is_known(open_store) -> None:
    a, b = open_store(), open_store()
    a.arrive("s", "m", "r", b"{}", 1.0)
    read = b.get("s", "m")
    assert read is not None
    assert a.begin_send(read, 10.0, 20.0) is Claim.CLAIMED
    assert b.begin_send(read, 15.0, 25.0) is Claim.BUSY  # a is sending it
    # a died before recording its answer: after the claim ran out the send is known
    assert b.begin_send(read, 21.0, 31.0) is Claim.INTERRUPTED
    b.record_attempt("s", "m", Attempt(22.0, "deliver", 200, 1.0))  # answered: mark cleared
    # a worker that read the message before that attempt may not send it again
    assert a.begin_send(read, 23.0, 33.0) is Claim.MOVED
    again = a.get("s", "m")
    assert again is not None and a.begin_send(again, 23.0, 33.0) is Claim.CLAIMED
    a.advance("s", "m", Status.FAILED, 24.0, reason="x")
    assert b.begin_send(again, 25.0, 35.0) is Claim.MOVED  # its status moved on
    with pytest.raises(UnknownMessage):
        a.begin_send(replace(read, message_id="missing"), 1.0, 2.0)


def test_failed_messages_are_listed_and_retried_from_the_stage_that_failed(store) -> None:
    store.arrive("s", "never-sent", "ci", b"{}", 1.0)
    store.advance("s", "never-sent", Status.FAILED, 2.0, reason="400")
    store.arrive("s", "no-result", "ci", b"{}", 1.0)
    store.advance("s", "no-result", Status.DELIVERED_TO_RECEIVER, 2.0)
    store.advance("s", "no-result", Status.FAILED, 3.0, reason="ttl")
    store.arrive("s", "no-callback", "other", b"{}", 1.0)
    store.advance(
        "s",
        "no-callback",
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
        2.0,
        response=b"{}",
        via=Status.DELIVERED_TO_RECEIVER,
    )
    store.advance("s", "no-callback", Status.FAILED, 4.0, reason="callback 400")
    store.arrive("s", "fine", "ci", b"{}", 1.0)
    listed = [(m.message_id, m.reason) for m in store.failed()]
    assert listed == [("never-sent", "400"), ("no-result", "ttl"), ("no-callback", "callback 400")]
    assert [m.message_id for m in store.failed(receiver="ci", since=2.5)] == ["no-result"]
    assert [m.message_id for m in store.failed(limit=1)] == ["never-sent"]
    # a late step cannot bring a FAILED message back: only a retry does
    with pytest.raises(InvalidTransition):
        store.advance("s", "never-sent", Status.DELIVERED_TO_RECEIVER, 5.0)
    expected = {
        "never-sent": (Status.ARRIVED, DELIVER),
        "no-result": (Status.DELIVERED_TO_RECEIVER, POLL),
        "no-callback": (Status.RESPONSE_RECEIVED_FROM_RECEIVER, CALLBACK),
    }
    for message_id, (status, kind) in expected.items():
        resumed, scheduled = store.retry("s", message_id, 10.0)
        assert (resumed.status, scheduled, resumed.reason) == (status, kind, "")
        assert resumed.history[-1].reason == "retried"
        assert store.take_due(kind, 10.0, 10) == [("s", message_id)]
    assert store.failed() == []
    with pytest.raises(InvalidTransition):
        store.retry("s", "fine", 11.0)


def test_two_transitions_in_one_step(store) -> None:
    store.arrive("s", "m", "r", b"{}", 1.0)
    done = store.advance(
        "s",
        "m",
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
        2.0,
        response=b"ok",
        via=Status.DELIVERED_TO_RECEIVER,
    )
    assert [t.status for t in done.history] == [
        Status.ARRIVED,
        Status.DELIVERED_TO_RECEIVER,
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
    ]
    with pytest.raises(InvalidTransition):  # not from where it is now
        store.advance("s", "m", Status.DONE, 3.0, via=Status.RESPONSE_RECEIVED_FROM_RECEIVER)


def test_receivers_are_disabled_and_enabled(open_store) -> None:
    a, b = open_store(), open_store()
    assert a.receivers() == {}
    a.set_receiver("ci", True, "410 gone", 5.0)
    assert b.receivers() == {"ci": ReceiverState("ci", True, "410 gone", 5.0)}
    b.set_receiver("ci", False, "", 6.0)
    assert not a.receivers()["ci"].disabled


def test_done_messages_are_forgotten_after_their_retention(store: StateStore) -> None:
    for message_id, done_at in (("old", 10.0), ("new", 50.0)):
        store.arrive("s", message_id, "r", b"{}", 1.0)
        store.advance(
            "s",
            message_id,
            Status.RESPONSE_RECEIVED_FROM_RECEIVER,
            done_at - 1,
            response=b"{}",
            via=Status.DELIVERED_TO_RECEIVER,
        )
        store.advance("s", message_id, Status.DONE, done_at)
    store.arrive("s", "failed", "r", b"{}", 1.0)
    store.advance("s", "failed", Status.FAILED, 2.0, reason="x")
    store.arrive("s", "waiting", "r", b"{}", 1.0)
    assert store.purge(before=20.0) == 1
    assert store.get("s", "old") is None and not store.known("s", "old")
    assert all(store.get("s", m) is not None for m in ("new", "failed", "waiting"))
    assert store.purge(before=20.0) == 0
    assert store.purge(before=60.0, limit=5) == 1
    created, again = store.arrive("s", "old", "r", b"{}", 70.0)  # a repeat is new now
    assert created and again.status is Status.ARRIVED


def _walk(
    store: StateStore,
    source_id: str | None,
    status: str | None,
    receiver: str | None,
    limit: int,
    before: Cursor | None = None,
) -> list[Cursor]:
    """Every message listed (after ``before``), page after page."""
    seen: list[Cursor] = []
    while page := store.messages(source_id, status, receiver, limit, before):
        assert len(page) <= limit
        assert before is None or cursor(page[0]) < before  # on past it (a bad cursor: no hang)
        seen += [cursor(m) for m in page]
        before = seen[-1]
    return seen


def _counts(**by_status: int) -> dict[str, int]:
    return {s.value: by_status.get(s.name, 0) for s in Status}


def test_messages_are_listed_newest_first(store: StateStore) -> None:
    store.arrive("b", "m1", "ci", b"{}", 5.0)
    store.arrive("a", "m2", "ci", b"{}", 5.0)
    store.arrive("ab", "m0", "ci", b"{}", 5.0)  # ("a", ...) < ("ab", ...): ids are compared
    store.arrive("a", "m1", "ci", b"{}", 5.0)
    store.arrive("a", "m3", "other", b'{"x": 1}', 7.0)
    store.arrive("c", "m0", "ci", b"{}", 1.0)
    store.advance("c", "m0", Status.DELIVERED_TO_RECEIVER, 6.0)  # a change moves it up
    listed = store.messages(None, None, None, 10)
    assert [cursor(m) for m in listed] == [
        (7.0, "a", "m3"),
        (6.0, "c", "m0"),
        (5.0, "b", "m1"),
        (5.0, "ab", "m0"),
        (5.0, "a", "m2"),
        (5.0, "a", "m1"),
    ]
    assert listed[0] == store.get("a", "m3") and listed[0].payload == b'{"x": 1}'
    assert listed[1].status is Status.DELIVERED_TO_RECEIVER and len(listed[1].history) == 2
    assert store.messages(None, None, None, 2) == listed[:2]
    assert store.messages(None, None, None, 0) == store.messages(None, None, None, -1) == []


def test_messages_are_filtered_by_source_status_and_receiver(store: StateStore) -> None:
    rng = random.Random(7)
    for i in range(60):
        source, receiver = rng.choice(["s1", "s2", "s3"]), rng.choice(["r1", "r2"])
        store.arrive(source, f"m{i}", receiver, b"{}", float(rng.randrange(5)))
        state = store.get(source, f"m{i}")
        assert state is not None
        path = rng.choice(
            [
                [],
                ["DELIVERED_TO_RECEIVER"],
                ["FAILED"],
                ["DELIVERED_TO_RECEIVER", "RESPONSE_RECEIVED_FROM_RECEIVER", "DONE"],
            ]
        )
        for k, status in enumerate(path):
            store.advance(source, f"m{i}", Status(status), 10.0 + rng.randrange(3) + k)
    every = store.messages(None, None, None, 100)
    assert len(every) == 60
    assert [m.status for m in store.messages(None, "FAILED", None, 100)] == [
        Status.FAILED for m in every if m.status is Status.FAILED
    ]
    assert {m.receiver for m in store.messages(None, None, "r2", 100)} == {"r2"}
    assert {m.source_id for m in store.messages("s3", None, None, 100)} == {"s3"}
    for source, status, receiver in itertools.product(
        [None, "s1", "s2", "nope"], [None, *Status], [None, "r1", "r2", "nope"]
    ):
        wanted = [
            m
            for m in every
            if source in (None, m.source_id)
            and status in (None, m.status)
            and receiver in (None, m.receiver)
        ]
        assert store.messages(source, status, receiver, 100) == wanted, (source, status, receiver)
    with pytest.raises(ValueError):
        store.messages(None, "LOST", None, 10)


def test_cursor_paging_walks_every_message_exactly_once(store: StateStore) -> None:
    rng = random.Random(11)
    for i in range(80):  # few distinct times: many ties, across pages
        source = rng.choice(["a", "ab", "b"])
        store.arrive(
            source,
            f"m{rng.randrange(10**6):06d}-{i}",
            rng.choice(["r1", "r2"]),
            b"{}",
            float(rng.randrange(4)),
        )
    for m in store.messages(None, None, None, 100)[::3]:
        store.advance(m.source_id, m.message_id, Status.FAILED, 9.0, reason="x")
    for source, status, receiver in itertools.product(
        [None, "a", "ab"], [None, "ARRIVED", "FAILED"], [None, "r1"]
    ):
        everything = [cursor(m) for m in store.messages(source, status, receiver, 1000)]
        assert everything, (source, status, receiver)
        for limit in (1, 7, 50):
            assert _walk(store, source, status, receiver, limit) == everything
    # pages are stable: a message that changes during the walk moves to the top (it is not
    # listed again below), a new one arrives there; every other one is listed once
    unchanged = [cursor(m) for m in store.messages(None, None, None, 1000)]
    first = store.messages(None, None, None, 10)
    later = store.messages(None, None, None, 10, cursor(first[-1]))[5]
    if later.status is Status.FAILED:
        moved, _ = store.retry(later.source_id, later.message_id, 20.0)
    else:
        moved = store.advance(later.source_id, later.message_id, Status.FAILED, 20.0, reason="x")
    store.arrive("a", "new", "r1", b"{}", 21.0)
    rest = _walk(store, None, None, None, 10, cursor(first[-1]))
    assert [cursor(m) for m in first] + rest == [c for c in unchanged if c != cursor(later)]
    assert [m.key for m in store.messages(None, None, None, 2)] == [("a", "new"), moved.key]


def test_counts_follow_the_transitions(store: StateStore) -> None:
    assert store.counts() == {}
    store.arrive("s", "m", "ci", b"{}", 1.0)
    store.arrive("s", "other", "cd", b"{}", 1.0)
    assert store.counts() == {"ci": _counts(ARRIVED=1), "cd": _counts(ARRIVED=1)}
    steps = [
        (Status.DELIVERED_TO_RECEIVER, _counts(DELIVERED_TO_RECEIVER=1)),
        (Status.RESPONSE_RECEIVED_FROM_RECEIVER, _counts(RESPONSE_RECEIVED_FROM_RECEIVER=1)),
        (Status.FAILED, _counts(FAILED=1)),
    ]
    for k, (status, counted) in enumerate(steps):
        store.advance("s", "m", status, 2.0 + k, reason="x", response=b"{}")
        assert store.counts(receiver="ci") == {"ci": counted}
    assert [m.key for m in store.messages(None, "FAILED", "ci", 10)] == [("s", "m")]
    resumed, _ = store.retry("s", "m", 10.0)  # back to its stage: the callback
    assert resumed.status is Status.RESPONSE_RECEIVED_FROM_RECEIVER
    assert store.counts("ci") == {"ci": _counts(RESPONSE_RECEIVED_FROM_RECEIVER=1)}
    assert store.messages(None, "FAILED", None, 10) == []
    store.advance("s", "m", Status.DONE, 11.0)
    assert store.counts() == {"ci": _counts(DONE=1), "cd": _counts(ARRIVED=1)}
    assert store.counts("nobody") == {}
    assert store.purge(before=20.0) == 1  # forgotten: no longer counted, nor listed
    assert store.counts() == {"cd": _counts(ARRIVED=1)}
    assert [m.key for m in store.messages(None, None, None, 10)] == [("s", "other")]


def test_counts_stay_right_under_concurrent_workers(open_store) -> None:
    stores = [open_store() for _ in range(3)]
    stores[0].arrive_many([("s", f"m{i}", f"r{i % 2}", b"{}") for i in range(150)], 1.0)

    def worker(k: int) -> None:
        for i in range(150):
            for status in (Status.DELIVERED_TO_RECEIVER, Status.FAILED):
                with contextlib.suppress(InvalidTransition):
                    stores[k].advance("s", f"m{i}", status, 2.0 + k, reason="x")
            with contextlib.suppress(InvalidTransition):
                stores[k].retry("s", f"m{i}", 5.0 + k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # whoever won each step, the last one was a retry: each is back to its delivery
    resumed = _counts(DELIVERED_TO_RECEIVER=75)
    assert stores[1].counts() == {"r0": resumed, "r1": resumed}
    assert len(_walk(stores[2], None, "DELIVERED_TO_RECEIVER", None, 40)) == 150


def test_ten_thousand_messages_are_listed_in_order(store: StateStore) -> None:
    rng = random.Random(3)
    batch = [(f"src{i % 7}", f"m{i:05d}", f"r{i % 3}", b"{}") for i in range(10_000)]
    known: dict[tuple[str, str], tuple[float, Status, str]] = {}
    for start in range(0, 10_000, 1000):  # 1000 arrive at once: ties
        store.arrive_many(batch[start : start + 1000], float(start // 1000))
        for source, message, receiver, _ in batch[start : start + 1000]:
            known[source, message] = (float(start // 1000), Status.ARRIVED, receiver)
    for k, i in enumerate(rng.sample(range(10_000), 2000)):
        source, message, receiver, _ = batch[i]
        status = Status.FAILED if k % 2 else Status.DELIVERED_TO_RECEIVER
        store.advance(source, message, status, 100.0 + k % 10, reason="x")
        known[source, message] = (100.0 + k % 10, status, receiver)

    def expected(source: str | None, status: Status | None, receiver: str | None) -> list[Cursor]:
        return sorted(
            (
                (at, s, m)
                for (s, m), (at, st, r) in known.items()
                if source in (None, s) and status in (None, st) and receiver in (None, r)
            ),
            reverse=True,
        )

    assert _walk(store, None, None, None, 50) == expected(None, None, None)
    assert _walk(store, None, "FAILED", "r1", 50) == expected(None, Status.FAILED, "r1")
    assert _walk(store, "src3", None, None, 50) == expected("src3", None, None)
    assert _walk(store, "src3", "ARRIVED", "r2", 50) == expected("src3", Status.ARRIVED, "r2")
    assert store.counts("r0") == {
        "r0": {
            s.value: sum(1 for _, st, r in known.values() if st is s and r == "r0") for s in Status
        }
    }


def test_redis_a_source_is_listed_in_bounded_walks(redis_service) -> None:
    """A source's page walks its statuses' sets (a source is not indexed) at most ``walk``
    members a set a script: a page takes as many scripts as it needs, and every page but the
    last is full, in order, each message once."""
    store = RedisState(redis_service.url, prefix=f"test:{uuid.uuid4().hex[:6]}:")
    store.walk = 7
    batch = [(f"src{i % 5}", f"m{i:04d}", f"r{i % 2}", b"{}") for i in range(600)]
    known: dict[tuple[str, str], tuple[float, Status, str]] = {}
    for start in range(0, 600, 100):  # 100 arrive at once: ties
        store.arrive_many(batch[start : start + 100], float(start // 100))
        for source, message, receiver, _ in batch[start : start + 100]:
            known[source, message] = (float(start // 100), Status.ARRIVED, receiver)
    for k, (source, message, receiver, _) in enumerate(batch[::3]):
        store.advance(source, message, Status.FAILED, 50.0 + k % 4, reason="x")
        known[source, message] = (50.0 + k % 4, Status.FAILED, receiver)
    scripts = 0
    run = store._messages

    def counted(**kw: Any) -> Any:
        nonlocal scripts
        scripts += 1
        return run(**kw)

    store._messages = counted  # type: ignore[method-assign]
    for source, status, receiver in [
        ("src3", None, None),
        ("src1", "FAILED", None),
        ("src4", None, "r1"),
        ("src0", "ARRIVED", "r0"),
    ]:
        wanted = sorted(
            (
                (at, s, m)
                for (s, m), (at, st, r) in known.items()
                if s == source and status in (None, st.value) and receiver in (None, r)
            ),
            reverse=True,
        )
        pages, before, seen = 0, None, []
        while page := store.messages(source, status, receiver, 9, before):
            pages += 1
            seen += [cursor(m) for m in page]
            assert len(page) == 9 or len(seen) == len(wanted)
            before = seen[-1]
        assert seen == wanted
        assert pages == -(-len(wanted) // 9)
    assert scripts > 200  # (each walk of 7 members finds about one message of a source)
    store.close()


def test_redis_lists_the_messages_recorded_before_the_listing(redis_service) -> None:
    import redis

    prefix = f"test[{uuid.uuid4().hex[:6]}]*:"  # glob characters: the scan must escape them
    old = RedisState(redis_service.url, prefix=prefix)
    for i in range(700):
        old.arrive(f"s{i % 3}", f"m{i}", f"r{i % 2}", b"{}", float(i % 5))
    for i in range(0, 700, 4):
        old.advance(f"s{i % 3}", f"m{i}", Status.FAILED, 10.0, reason="x")
    listed: list[MessageState] = old.messages(None, None, None, 1000)
    counted = old.counts()
    client = redis.Redis.from_url(redis_service.url)
    listing = [k for k in client.scan_iter(count=1000) if k.startswith(f"{prefix}l".encode())]
    client.delete(*listing)  # as a store from before the listing left its messages
    fresh = RedisState(redis_service.url, prefix=prefix)
    assert fresh.counts() == counted
    assert fresh.messages(None, None, None, 1000) == listed
    assert fresh.messages("s1", "FAILED", "r0", 1000) == [
        m for m in listed if m.key[0] == "s1" and m.status is Status.FAILED and m.receiver == "r0"
    ]
    for store in (old, fresh):
        store.close()
    client.close()


def test_redis_scores_in_seconds_from_an_older_store_are_listed_again(redis_service) -> None:
    """A store whose sets were scored in seconds (as they once were, not in whole microseconds)
    is listed again on first use: its pages, its failed messages since a time and its purge
    answer as they would in a new store; the sets by source it kept are deleted, and so, at its
    first purge, is the set of DONE messages it kept beside the listing."""
    import redis

    prefix = f"test[{uuid.uuid4().hex[:6]}]:"
    old = RedisState(redis_service.url, prefix=prefix)
    for i in range(300):
        old.arrive(f"s{i % 3}", f"m{i}", f"r{i % 2}", b"{}", 100.0 + i)
    for i in range(0, 300, 3):
        old.advance(f"s{i % 3}", f"m{i}", Status.FAILED, 1000.0 + i, reason="x")
    for i in range(1, 300, 3):
        key = (f"s{i % 3}", f"m{i}")
        responded = Status.RESPONSE_RECEIVED_FROM_RECEIVER
        old.advance(*key, responded, 999.0, response=b"{}", via=Status.DELIVERED_TO_RECEIVER)
        old.advance(*key, Status.DONE, 1000.0 + i)
    listed = old.messages(None, None, None, 1000)
    failed = old.failed(since=1150.0)
    client = redis.Redis.from_url(redis_service.url)
    for key in client.scan_iter(match=f"{prefix}*".encode(), count=1000):
        name = key[len(prefix) :]
        if name.startswith((b"l:", b"lr:", b"ls:", b"lsr:")) or name in (b"f", b"d"):
            rescored = {m: s / 1e6 for m, s in client.zrange(key, 0, -1, withscores=True)}
            client.zadd(key, rescored)  # as an older store scored them: in seconds
    client.delete(f"{prefix}lv2")
    by_source = [f"{prefix}ls:s1\0ARRIVED", f"{prefix}lsr:s1\0r1\0ARRIVED"]
    for key in by_source:  # the sets by source an older store kept
        client.zadd(key, {"s1\0m1": 100.0})
    client.zadd(f"{prefix}d", {"s1\0m1": 1001.0})  # and its DONE messages beside l:DONE
    fresh = RedisState(redis_service.url, prefix=prefix)
    assert [m.key for m in fresh.failed(since=1150.0)] == [m.key for m in failed]
    assert client.exists(*by_source) == 0
    assert fresh.messages(None, None, None, 1000) == listed
    first = fresh.messages("s1", None, "r0", 7)
    assert (
        fresh.messages("s1", None, "r0", 1000, before=cursor(first[-1]))
        == [m for m in listed if m.key[0] == "s1" and m.receiver == "r0"][7:]
    )
    assert fresh.purge(before=1100.0) == len(range(1, 100, 3))
    assert client.exists(f"{prefix}d") == 0
    counted = sum(n for by_status in fresh.counts().values() for n in by_status.values())
    assert counted == 300 - len(range(1, 100, 3))
    for store in (old, fresh):
        store.close()
    client.close()


def test_move_returns_what_advance_would_read_back(open_store) -> None:
    """``move`` (the workers' hot path, which may skip reading the message back) leaves the
    message as ``advance`` does and returns it as it is; refused and unknown as advance is."""
    a, b = open_store(), open_store()
    for m in ("moved", "advanced"):
        a.arrive("s", m, "ci", b"{}", 1.0)
    attempt = Attempt(2.0, "deliver", 200, 3.5, '{"ok":1}')
    moved = a.move(
        a.get("s", "moved"),  # type: ignore[arg-type]
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
        2.5,
        response=b'{"ok":1}',
        via=Status.DELIVERED_TO_RECEIVER,
        attempt=attempt,
    )
    advanced = a.advance(
        "s",
        "advanced",
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
        2.5,
        response=b'{"ok":1}',
        via=Status.DELIVERED_TO_RECEIVER,
        attempt=attempt,
    )
    assert moved == replace(advanced, message_id="moved")
    assert b.get("s", "moved") == moved  # as stored
    failed = b.move(moved, Status.FAILED, 3.0, reason="no")
    assert failed.reason == "no" and failed == a.get("s", "moved")
    with pytest.raises(InvalidTransition):
        a.move(moved, Status.DONE, 4.0)  # it is FAILED now
    with pytest.raises(UnknownMessage):
        a.move(replace(moved, message_id="nobody"), Status.DONE, 4.0)


def test_a_message_may_be_claimed_for_its_first_send_as_it_arrives(open_store) -> None:
    """A claim given with an arrival holds as ``begin_send``'s would: another worker finds the
    message BUSY until it runs out, then INTERRUPTED. A message known already is not claimed
    by its repeat's arrival."""
    a, b = open_store(), open_store()
    batch = [("s", "m", "ci", b"{}"), ("s", "n", "ci", b"{}")]
    (m_new, m), (n_new, n) = a.arrive_many(batch, 1.0, [20.0, None])
    assert m_new and n_new
    assert b.get("s", "m") == m  # (the claim is not part of the message)
    assert b.begin_send(m, 10.0, 30.0) is Claim.BUSY
    assert b.begin_send(m, 25.0, 40.0) is Claim.INTERRUPTED
    ((again, known),) = a.arrive_many([("s", "n", "ci", b"{}")], 2.0, [50.0])
    assert not again and known == n
    assert b.begin_send(n, 3.0, 30.0) is Claim.CLAIMED  # the repeat claimed nothing


def test_a_move_may_pass_through_several_statuses_with_several_attempts(open_store) -> None:
    """A step that got the response and made its callback records both in one move: each
    status passed through at ``via_at``, the last at ``now``, the attempts in order; the
    send's claim is over. The path must be one the machine allows, from where the message is."""
    a, b = open_store(), open_store()
    (_, m), (_, n) = a.arrive_many([("s", "m", "ci", b"{}"), ("s", "n", "ci", b"{}")], 1.0)
    assert a.begin_send(m, 1.0, 20.0) is Claim.CLAIMED
    delivered = Attempt(1.5, "deliver", 200, 3.5, '{"ok":1}')
    called_back = Attempt(2.5, "callback", 200, 1.0)
    through = (Status.DELIVERED_TO_RECEIVER, Status.RESPONSE_RECEIVED_FROM_RECEIVER)
    done = a.move(
        m,
        Status.DONE,
        3.0,
        response=b'{"ok":1}',
        via=through,
        via_at=2.0,
        attempt=(delivered, called_back),
    )
    assert b.get("s", "m") == done
    assert [(t.status, t.at) for t in done.history] == [
        (Status.ARRIVED, 1.0),
        (Status.DELIVERED_TO_RECEIVER, 2.0),
        (Status.RESPONSE_RECEIVED_FROM_RECEIVER, 2.0),
        (Status.DONE, 3.0),
    ]
    assert done.attempts == (delivered, called_back)
    assert (done.response, done.updated_at) == (b'{"ok":1}', 3.0)
    # a callback that failed: the response is recorded with both attempts, and the claim ends
    assert a.begin_send(n, 1.0, 20.0) is Claim.CLAIMED
    failed_back = Attempt(2.5, "callback", 503, 1.0)
    responded = a.move(
        n,
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
        2.0,
        response=b"{}",
        via=Status.DELIVERED_TO_RECEIVER,
        attempt=(delivered, failed_back),
    )
    assert b.get("s", "n") == responded and responded.attempts == (delivered, failed_back)
    assert b.begin_send(responded, 3.0, 30.0) is Claim.CLAIMED
    with pytest.raises(InvalidTransition):  # DONE now: it cannot pass through DELIVERED again
        a.move(done, Status.DONE, 4.0, via=through)
    with pytest.raises(ValueError, match="cannot come from"):
        a.move(m, Status.DONE, 4.0, via=(Status.DELIVERED_TO_RECEIVER,))
