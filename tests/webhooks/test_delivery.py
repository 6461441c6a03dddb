"""One delivery against a real local receiver (headwater.testing.webhooks): signed requests the
standardwebhooks library verifies, what each kind of answer means (sync result, accepted, retry
with Retry-After, gone, terminal), timeouts and resets as ambiguous failures, asking the
receiver's status before a resend, and the retry schedule with its jitter."""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from headwater.http.client import HttpClient
from headwater.http.headers import retry_after
from headwater.testing.webhooks import Reply, running_receiver
from headwater.webhooks.config import SVIX_RETRY_SCHEDULE_S, ReceiverConfig
from headwater.webhooks.delivery import (
    Outcome,
    Verdict,
    ask_status,
    deliver,
    judge,
    next_attempt_at,
)
from headwater.webhooks.signing import Signer

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
SIGNER = Signer.from_secrets([SECRET])
PAYLOAD = b'{"event": "push"}'
T = TypeVar("T")


def run(make: Callable[[HttpClient], Awaitable[T]]) -> T:
    async def go() -> T:
        async with HttpClient() as session:
            return await make(session)

    return asyncio.run(go())


def config(url: str, status_url: str | None = None, **over: Any) -> ReceiverConfig:
    return ReceiverConfig(name="ci", url=url, status_url=status_url, secret=[SECRET], **over)


def send(receiver_url: str, message_id: str = "m1", **over: Any) -> Outcome:
    receiver = config(receiver_url, **over)
    return run(lambda s: deliver(s, receiver, SIGNER, message_id, PAYLOAD))


def test_a_sync_result_signed_and_verified() -> None:
    with running_receiver(SECRET, script=lambda n, r: Reply(200, b'{"build": 7}')) as receiver:
        outcome = send(receiver.url)
    assert outcome.verdict is Verdict.RESULT and outcome.body == b'{"build": 7}'
    assert outcome.attempt.status_code == 200 and outcome.attempt.kind == "deliver"
    assert outcome.attempt.excerpt == '{"build": 7}' and outcome.attempt.duration_ms > 0
    (request,) = receiver.requests
    assert request.verified and request.body == PAYLOAD and request.message_id == "m1"


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        (Reply(202, b'{"queued": true}'), Verdict.ACCEPTED),
        (Reply(204), Verdict.ACCEPTED),
        (Reply(200, b"  "), Verdict.ACCEPTED),
        (Reply(429, headers={"Retry-After": "7"}), Verdict.RETRY),
        (Reply(503), Verdict.RETRY),
        (Reply(500), Verdict.RETRY),
        (Reply(408), Verdict.RETRY),
        (Reply(410), Verdict.GONE),
        (Reply(400, b"bad payload"), Verdict.FAILED),
        (Reply(301, headers={"Location": "/elsewhere"}), Verdict.FAILED),
    ],
)
def test_what_each_answer_means(reply: Reply, verdict: Verdict) -> None:
    with running_receiver(SECRET, script=lambda n, r: reply) as receiver:
        outcome = send(receiver.url)
    assert outcome.verdict is verdict
    assert not outcome.ambiguous
    if reply.status == 429:
        assert outcome.retry_after_s == 7.0
    if reply.status == 400:
        assert outcome.reason == "the receiver answered 400: bad payload"


def test_a_timeout_and_a_reset_are_ambiguous_retries() -> None:
    with running_receiver(SECRET, script=lambda n, r: Reply(200, delay_s=2.0)) as receiver:
        slow = send(receiver.url, timeout_s=0.3)
    assert slow.verdict is Verdict.RETRY and slow.ambiguous
    assert slow.attempt.status_code is None and "0.3 s" in slow.reason
    with running_receiver(SECRET, script=lambda n, r: Reply(reset=True)) as receiver:
        reset = send(receiver.url)
        assert len(receiver.posts()) == 1  # it arrived: only its answer was lost
    assert reset.verdict is Verdict.RETRY and reset.ambiguous and reset.reason


def test_nobody_listening_is_a_retry() -> None:
    with running_receiver(SECRET) as receiver:
        url = receiver.url
    outcome = send(url)
    assert outcome.verdict is Verdict.RETRY and outcome.attempt.status_code is None


def test_asking_the_status_before_resending() -> None:
    script = {"m-result": Reply(200, b'{"ok": 1}'), "m-pending": Reply(202)}
    with running_receiver(SECRET, script=lambda n, r: script[r.message_id]) as receiver:
        receiver_config = config(receiver.url, receiver.status_url)
        for message_id in script:
            run(lambda s, m=message_id: deliver(s, receiver_config, SIGNER, m, PAYLOAD))

        def ask(message_id: str) -> Outcome:
            return run(lambda s: ask_status(s, receiver_config, SIGNER, message_id))

        never = ask("m-never")
        assert never.verdict is Verdict.FAILED and never.attempt.status_code == 404
        done = ask("m-result")
        assert done.verdict is Verdict.RESULT and done.body == b'{"ok": 1}'
        assert ask("m-pending").verdict is Verdict.ACCEPTED
        polls = [r for r in receiver.requests if r.method == "GET"]
        assert len(polls) == 3 and all(r.verified for r in polls)
        assert done.attempt.kind == "poll"


def test_the_retry_schedule_with_jitter_and_retry_after() -> None:
    receiver = config("http://127.0.0.1:9/hooks")
    assert receiver.retry_schedule_s == list(SVIX_RETRY_SCHEDULE_S)
    rng = random.Random(1)
    waits = [next_attempt_at(receiver, n, 0.0, rng=rng) for n in range(1, 8)]
    for wait, scheduled in zip(waits, SVIX_RETRY_SCHEDULE_S, strict=True):
        assert wait is not None and 0.8 * scheduled <= wait <= 1.2 * scheduled
    assert next_attempt_at(receiver, 8, 0.0) is None  # seven retries, then no more
    assert next_attempt_at(receiver, 1, 100.0, asked_s=60.0, rng=rng) == 160.0  # Retry-After wins


def test_retry_after_forms() -> None:
    assert retry_after("120", 0.0) == 120.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412470.0) == 10.0
    assert retry_after("soon", 0.0) is None and retry_after(None, 0.0) is None
    assert judge(201, b"{}") is Verdict.RESULT
