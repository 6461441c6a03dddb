"""The webhook state contract, run over both backends (embedded SQLite and Redis): dedup on
arrival, the status machine with its timestamped history, attempts kept in order, schedules
claimed once, a rate limit shared by every worker, and several processes' worth of workers on
one store."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from headwater.webhooks.state import (
    Attempt,
    InvalidTransition,
    StateStore,
    Status,
    UnknownMessage,
)
from headwater.webhooks.state.base import CALLBACK, DELIVER, POLL, Claim, ReceiverState
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
