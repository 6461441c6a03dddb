"""The ``http`` destination's delivery core in one task, against a real local receiver: per-session
batches in log order with one request in flight per session, size-cut batches with deterministic
idempotency keys, 413 splits, trimming of oversize events, retries honouring Retry-After, giving
up into the failed store, 401 stopping the destination, other 4xx failed, and one failing
session never holding the others."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from typing import Any

import pytest

from headwater.delivery.bodies import TRIMMED, BodyFormat, Event, trim
from headwater.delivery.config import HttpDeliveryConfig
from headwater.delivery.sender import DestinationRefused, Sender
from headwater.delivery.sessions import Report, TaskDelivery
from headwater.http.client import HttpClient
from headwater.testing.http_receiver import Batch, BatchReceiver, running_batch_receiver
from headwater.testing.webhooks import Reply

FAST_RETRY = {"initial_s": 0.05, "max_interval_s": 0.2, "max_elapsed_s": 5.0}


def config(receiver: BatchReceiver, **extra: Any) -> HttpDeliveryConfig:
    return HttpDeliveryConfig.model_validate(
        {"url": receiver.url, "retry": FAST_RETRY, "timeout_s": 2, **extra}
    )


def events(n: int, sessions: int, pad: int = 100) -> list[tuple[str, Event]]:
    out = []
    for i in range(n):
        key = f"user-{i % sessions}"
        doc = {"user": key, "n": i, "pad": "x" * pad}
        out.append((key, Event(json.dumps(doc).encode(), ts_ns=1_700_000_000_000_000_000 + i)))
    return out


def deliver(
    cfg: HttpDeliveryConfig,
    items: list[tuple[str, Event]],
    batch_id: int = 7,
    max_pending_bytes: int | None = None,
) -> Report:
    async def go() -> Report:
        async with HttpClient() as http:
            sender = Sender(cfg, http, rng=random.Random(1))
            task = TaskDelivery(sender, "api", batch_id, max_pending_bytes=max_pending_bytes)
            return await task.run(items)

    return asyncio.run(go())


def by_session(batches: list[Batch]) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    for b in sorted(batches, key=lambda b: b.started):
        seen[b.session] += [e["n"] for e in b.events]
    return seen


@pytest.mark.parametrize("fmt", ["ndjson", "json", "dataset"])
def test_sessions_in_order_one_request_in_flight_each(fmt: str) -> None:
    with running_batch_receiver(lambda n, b: Reply(200, delay_s=0.005)) as receiver:
        cfg = config(receiver, format=fmt, max_batch_bytes=3000, max_parallel_sessions=8)
        items = events(3000, sessions=40)
        report = deliver(cfg, items)
    assert not receiver.overlaps  # never two requests of one session at once
    assert report.outcome.delivered == 3000 and not report.outcome.failed
    assert report.sessions == 40
    got = by_session(receiver.delivered())
    assert len(got) == 40
    for ns in got.values():
        assert ns == sorted(ns)  # log order within the session
    assert sorted(n for ns in got.values() for n in ns) == list(range(3000))  # each once
    assert all(b.body_bytes <= 3000 for b in receiver.requests)
    assert len(receiver.requests) > 100  # cut by size: many batches


def test_the_same_batch_sends_the_same_idempotency_keys() -> None:
    items = events(500, sessions=5)
    keys = []
    for _ in range(2):
        with running_batch_receiver() as receiver:
            deliver(config(receiver, max_batch_bytes=2000), items, batch_id=3)
        keys.append(sorted(b.key for b in receiver.requests))
    assert keys[0] == keys[1] and len(set(keys[0])) == len(keys[0])
    assert all(k.startswith("api:3:api-") for k in keys[0])


def test_a_413_splits_the_batch_until_it_fits() -> None:
    with running_batch_receiver(max_body_bytes=1500) as receiver:
        report = deliver(config(receiver, max_batch_bytes=12000), events(200, sessions=2))
    assert report.outcome.delivered == 200 and not report.outcome.failed
    assert sorted(n for ns in by_session(receiver.delivered()).values() for n in ns) == list(
        range(200)
    )
    refused = [b for b in receiver.requests if b.status == 413]
    assert refused and all(b.body_bytes > 1500 for b in refused)
    assert any(b.key.endswith(".0.1") or b.key.endswith(".1.0") for b in receiver.delivered())


def test_oversize_events_are_trimmed_longest_value_first_or_failed() -> None:
    big = {"n": 0, "note": "a" * 5000, "title": "b" * 800, "keep": "short"}
    fmt = BodyFormat("ndjson")
    trimmed = trim(Event(json.dumps(big).encode()), 1000, fmt)
    assert trimmed is not None and len(trimmed.data) + 1 <= 1000
    doc = json.loads(trimmed.data)
    assert doc[TRIMMED] == ["/note"] and doc["title"] == "b" * 800 and doc["keep"] == "short"
    assert len(doc["note"]) < 5000
    both = trim(Event(json.dumps(big).encode()), 300, fmt)
    assert both is not None and json.loads(both.data)[TRIMMED] == ["/note", "/title"]
    numbers = Event(json.dumps({"n": 0, "values": list(range(1000))}).encode())
    assert trim(numbers, 1000, fmt) is None
    with running_batch_receiver() as receiver:
        items = [("k", Event(json.dumps(big).encode())), ("k", numbers)]
        report = deliver(config(receiver, max_batch_bytes=1000), items)
    assert report.outcome.delivered == 1
    assert [e.data for e, _ in report.too_large] == [numbers.data]
    assert "max_batch_bytes (1000)" in report.too_large[0][1]


def test_transient_answers_are_retried_honouring_retry_after() -> None:
    replies = [Reply(503, headers={"Retry-After": "1"}), Reply(429), Reply(200)]
    with running_batch_receiver(lambda n, b: replies[min(n, 2)]) as receiver:
        report = deliver(config(receiver), events(10, sessions=1))
    assert report.outcome.delivered == 10 and report.outcome.retries == 2
    first, second, third = receiver.requests
    assert second.started - first.started >= 1.0  # Retry-After: 1
    assert first.key == second.key == third.key  # the same request, the same key


def test_past_max_elapsed_the_events_go_to_the_failed_store() -> None:
    with running_batch_receiver(lambda n, b: Reply(503, b"down")) as receiver:
        cfg = config(receiver, retry={**FAST_RETRY, "max_elapsed_s": 0.5})
        report = deliver(cfg, events(20, sessions=2))
    assert report.outcome.delivered == 0
    failed = [e for events_, _ in report.outcome.failed for e in events_]
    assert len(failed) == 20
    assert all("gave up after" in r and "503: down" in r for _, r in report.outcome.failed)
    assert len(receiver.requests) > 2


def test_a_401_stops_the_destination_and_a_400_fails_the_batch() -> None:
    refused = pytest.raises(DestinationRefused, match="refused the destination's credentials")
    with running_batch_receiver(lambda n, b: Reply(401, b"bad token")) as receiver, refused:
        deliver(config(receiver), events(5, sessions=1))
    with running_batch_receiver(lambda n, b: Reply(400, b"bad field x")) as receiver:
        report = deliver(config(receiver), events(5, sessions=1))
    ((failed, reason),) = report.outcome.failed
    assert len(failed) == 5 and reason == "the receiver answered 400: bad field x"


def test_a_failing_session_does_not_hold_the_others() -> None:
    slow: set[str] = set()

    def script(n: int, b: Batch) -> Reply:
        if not slow:
            slow.add(b.session)
        return Reply(503) if b.session in slow and n < 8 else Reply(200)

    with running_batch_receiver(script) as receiver:
        report = deliver(config(receiver, max_batch_bytes=1000), events(200, sessions=4))
    assert report.outcome.delivered == 200
    (stuck,) = slow
    ok = [b for b in receiver.delivered() if b.session != stuck]
    stuck_first_ok = min(b.started for b in receiver.delivered() if b.session == stuck)
    assert any(b.started < stuck_first_ok for b in ok)  # others went ahead meanwhile


def test_headers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_TOKEN", "s3cret")
    cfg = HttpDeliveryConfig(url="http://x", headers={"Authorization": "Bearer ${API_TOKEN}"})
    assert cfg.resolved_headers() == {"Authorization": "Bearer s3cret"}
    monkeypatch.delenv("API_TOKEN")
    with pytest.raises(ValueError, match="API_TOKEN, which is not set"):
        cfg.resolved_headers()


def test_memory_is_bounded_by_waiting_for_the_receiver() -> None:
    with running_batch_receiver(lambda n, b: Reply(200, delay_s=0.02)) as receiver:
        cfg = config(receiver, max_batch_bytes=2000, max_parallel_sessions=2)
        report = deliver(cfg, events(2000, sessions=50), max_pending_bytes=10_000)
    assert report.outcome.delivered == 2000 and not receiver.overlaps
