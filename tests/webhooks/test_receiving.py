"""The ToReceiver step against a real local receiver and the embedded state: sync results go to
the sender, retries wait on the state's schedule, an ambiguous failure is resolved by asking the
receiver before resending (no duplicate), 410 and 4xx fail the message with a reason, a spent
schedule gives up, a message already past ARRIVED is left alone, and the rate limit spaces the
requests."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from headwater.testing.webhooks import Receiver, Reply, Script, run_steps, running_receiver
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.state import MessageState, Status
from headwater.webhooks.state.base import DELIVER, POLL, Claim
from headwater.webhooks.state.sqlite import SqliteState

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
T = TypeVar("T")


class Harness:
    def __init__(self, tmp_path: Path, receiver: Receiver, **over: Any) -> None:
        status_url = over.pop("status_url", None)
        self.config = WebhooksConfig.model_validate(
            {
                "receivers": [
                    {
                        "name": "ci",
                        "url": receiver.url,
                        "status_url": status_url,
                        "secret": SECRET,
                        **over,
                    }
                ]
            }
        )
        self.store = SqliteState(tmp_path / "state.sqlite")
        self.responded: list[MessageState] = []

    def run(self, make: Callable[[Receiving], Awaitable[T]]) -> T:
        return run_steps(self.store, self.config, self.responded, make)

    def step(self, message_id: str = "m1") -> Step:
        return self.run(lambda r: r.to_receiver("github", message_id))

    def arrive(self, message_id: str = "m1") -> None:
        self.store.arrive("github", message_id, "ci", b'{"n": 1}', time.time())

    def status(self, message_id: str = "m1") -> MessageState:
        state = self.store.get("github", message_id)
        assert state is not None
        return state


def scripted(*replies: Reply) -> Script:
    return lambda n, r: replies[min(n, len(replies) - 1)]


def test_a_sync_result_goes_to_the_sender(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(200, b'{"build": 1}'))) as receiver:
        h = Harness(tmp_path, receiver)
        h.arrive()
        assert h.step() is Step.RESPONDED
        # run again (its record read again after a crash): handed on again, never sent twice
        assert h.step() is Step.RESPONDED
    state = h.status()
    assert state.status is Status.RESPONSE_RECEIVED_FROM_RECEIVER
    assert state.response == b'{"build": 1}'
    assert [t.status for t in state.history] == [
        Status.ARRIVED,
        Status.DELIVERED_TO_RECEIVER,
        Status.RESPONSE_RECEIVED_FROM_RECEIVER,
    ]
    assert [s.key for s in h.responded] == [("github", "m1")] * 2
    assert len(receiver.posts()) == 1 and receiver.posts()[0].verified


def test_a_transient_failure_waits_on_the_schedule(tmp_path: Path) -> None:
    replies = scripted(Reply(503, headers={"Retry-After": "30"}), Reply(200, b"{}"))
    with running_receiver(SECRET, replies) as receiver:
        h = Harness(tmp_path, receiver)
        h.arrive()
        assert h.step() is Step.SCHEDULED
        now = time.time()
        assert h.store.take_due(DELIVER, now + 29, 10) == []  # Retry-After: 30 s at least
        assert h.store.take_due(DELIVER, now + 31, 10) == [("github", "m1")]
        assert h.step() is Step.RESPONDED
    assert [a.status_code for a in h.status().attempts] == [503, 200]


def test_an_ambiguous_failure_is_asked_about_not_resent(tmp_path: Path) -> None:
    known = Reply(200, b'{"build": 2}')
    with running_receiver(
        SECRET, scripted(Reply(reset=True)), status_script=lambda n, r: known
    ) as receiver:
        h = Harness(tmp_path, receiver, status_url=receiver.status_url)
        h.arrive()
        assert h.step() is Step.SCHEDULED  # no answer: it may have arrived
        assert h.step() is Step.RESPONDED  # the receiver knows it: its result, no resend
        assert len(receiver.posts()) == 1
    state = h.status()
    assert state.response == b'{"build": 2}'
    assert [(a.kind, a.status_code) for a in state.attempts] == [("deliver", None), ("poll", 200)]


def test_a_timed_out_delivery_that_arrived_is_not_resent(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(200, delay_s=1.0), Reply(200, b"{}"))) as receiver:
        h = Harness(tmp_path, receiver, status_url=receiver.status_url, timeout_s=0.2)
        h.arrive()
        assert h.step() is Step.SCHEDULED
        # the slow POST did arrive; the status says "known, pending" (202): polled, not resent
        assert h.step() is Step.PENDING
        assert len(receiver.posts()) == 1
        assert h.store.take_due(POLL, time.time() + 5, 10) == [("github", "m1")]


def test_an_ambiguous_failure_the_receiver_never_saw_is_resent(tmp_path: Path) -> None:
    replies = scripted(Reply(reset=True), Reply(200, b"{}"))
    with running_receiver(SECRET, replies, status_script=lambda n, r: Reply(404)) as receiver:
        h = Harness(tmp_path, receiver, status_url=receiver.status_url)
        h.arrive()
        assert h.step() is Step.SCHEDULED
        assert h.step() is Step.RESPONDED  # 404: it never saw it, so it is sent again
        assert len(receiver.posts()) == 2
    kinds = [(a.kind, a.status_code) for a in h.status().attempts]
    assert kinds == [("deliver", None), ("poll", 404), ("deliver", 200)]


def test_accepted_without_a_status_url_is_the_response(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(202))) as receiver:
        h = Harness(tmp_path, receiver)
        h.arrive()
        assert h.step() is Step.RESPONDED
    assert h.status().response == b'{"status": 202}'


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (Reply(410), "the receiver ci is gone: the receiver answered 410"),
        (Reply(400, b"no such repo"), "the receiver answered 400: no such repo"),
    ],
)
def test_gone_and_terminal_answers_fail_the_message(
    tmp_path: Path, reply: Reply, reason: str
) -> None:
    with running_receiver(SECRET, scripted(reply)) as receiver:
        h = Harness(tmp_path, receiver)
        h.arrive()
        assert h.step() is Step.FAILED
    state = h.status()
    assert state.status is Status.FAILED and state.reason == reason
    assert not h.responded


def test_a_spent_schedule_gives_up(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(503))) as receiver:
        h = Harness(tmp_path, receiver, retry_schedule_s=[0.0])
        h.arrive()
        assert h.step() is Step.SCHEDULED
        assert h.step() is Step.FAILED
    assert h.status().reason == "gave up after 2 attempts: the receiver answered 503"


def test_the_rate_limit_spaces_requests(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(200, b"{}"))) as receiver:
        h = Harness(tmp_path, receiver, rate_limit={"requests": 10, "per_s": 1.0})
        ids = [f"m{i}" for i in range(12)]
        for m in ids:
            h.arrive(m)

        async def all_of(r: Receiving) -> list[Step]:
            return list(await asyncio.gather(*(r.to_receiver("github", m) for m in ids)))

        assert h.run(all_of) == [Step.RESPONDED] * 12
        times = sorted(p.at for p in receiver.posts())
    # 10 per second, evenly spaced: 12 requests span at least 1.1 s
    assert times[-1] - times[0] >= 1.0


def test_a_message_held_by_a_worker_that_died_is_looked_at_again(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(200, b'{"ok": 1}'))) as receiver:
        h = Harness(tmp_path, receiver, timeout_s=2)
        h.arrive()
        # another worker claimed the send, then died: its record is read again elsewhere
        assert h.store.begin_send(h.status(), time.time(), time.time() + 7) is Claim.CLAIMED
        before = time.time()
        assert h.step() is Step.SKIPPED  # busy: not sent twice at once
        (due,) = h.store.take_due(DELIVER, before + 60, 10)
        assert due == ("github", "m1")  # ...but it will be looked at again, not lost
        assert not receiver.posts()


def test_a_repeated_record_does_not_retry_before_the_schedule(tmp_path: Path) -> None:
    with running_receiver(SECRET, scripted(Reply(503), Reply(200, b"{}"))) as receiver:
        h = Harness(tmp_path, receiver, retry_schedule_s=[30])
        h.arrive()
        assert h.step() is Step.SCHEDULED  # 503: the retry waits 30 s (+-20%)
        from_topic = h.run(lambda r: r.to_receiver("github", "m1", from_topic=True))
        assert from_topic is Step.SCHEDULED and len(receiver.posts()) == 1  # not sooner
        (due,) = h.store.take_due(DELIVER, time.time() + 40, 10)
        assert due == ("github", "m1")


def test_a_remembered_message_that_changed_meanwhile_is_read_again(tmp_path: Path) -> None:
    """The step takes a message this process just recorded from memory; when another worker
    changed it since (here: an attempt recorded, then the message delivered and answered), the
    claim says MOVED and the step reads it, then hands it on, never sending it again."""
    with running_receiver(SECRET, scripted(Reply(200, b'{"ok": 1}'))) as receiver:
        h = Harness(tmp_path, receiver)
        h.arrive()
        arrived = h.status()

        async def changed_then_step(r: Receiving) -> Step:
            r.remember([arrived])
            h.store.advance(
                "github", "m1", Status.RESPONSE_RECEIVED_FROM_RECEIVER, time.time(),
                response=b'{"elsewhere": 1}', via=Status.DELIVERED_TO_RECEIVER,
            )  # fmt: skip
            return await r.to_receiver("github", "m1", from_topic=True)

        assert h.run(changed_then_step) is Step.RESPONDED  # handed on, as read
        assert receiver.requests == []
        assert [s.response for s in h.responded] == [b'{"elsewhere": 1}']

        h.arrive("m2")
        fresh = h.status("m2")

        async def unchanged(r: Receiving) -> Step:
            r.remember([fresh])
            step = await r.to_receiver("github", "m2", from_topic=True)
            assert r.arrived == {}  # taken
            return step

        assert h.run(unchanged) is Step.RESPONDED
        assert [r.message_id for r in receiver.requests] == ["m2"]


def test_remembered_messages_are_bounded_by_count_and_bytes(tmp_path: Path) -> None:
    from headwater.webhooks import receiving

    with running_receiver(SECRET, scripted(Reply(200, b"{}"))) as receiver:
        h = Harness(tmp_path, receiver)

        async def fill(r: Receiving) -> tuple[int, int]:
            big = b"x" * (receiving.REMEMBERED_BYTES // 4)
            r.remember([MessageState.arrived("s", f"b{i}", "ci", big, 1.0) for i in range(6)])
            by_bytes = len(r.arrived)
            r.arrived.clear()
            r._remembered_bytes = 0
            n = receiving.REMEMBERED + 5
            r.remember([MessageState.arrived("s", f"m{i}", "ci", b"{}", 1.0) for i in range(n)])
            assert ("s", "m0") not in r.arrived and ("s", f"m{n - 1}") in r.arrived  # oldest out
            return by_bytes, len(r.arrived)

        assert h.run(fill) == (4, receiving.REMEMBERED)
