"""The asynchronous result and the way back, against real local servers and the embedded
state: a receiver that accepts and answers later is polled until its result arrives (or the
ttl passes), and the result is POSTed, signed with the source's secret, to the sender's
callback; a callback that fails is retried on the schedule; a source with no callback is DONE
at once. A callback made in place, in the step that got the response, is recorded with it;
a send claimed with the message's arrival is not claimed again."""

from __future__ import annotations

import base64
import functools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from headwater.testing.webhooks import Receiver, Reply, Script, run_steps, running_receiver
from headwater.webhooks.callbacks import callback_body, to_sender
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.polling import next_poll_in, poll
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.state import MessageState, Status
from headwater.webhooks.state.base import CALLBACK, POLL, Claim
from headwater.webhooks.state.sqlite import SqliteState

RECEIVER_SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
SOURCE_SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
T = TypeVar("T")


def called_back(tmp_path: Path, receiver: Receiver, sender: Receiver) -> Flow:
    """A flow whose source is called back at ``sender``, with message m1 just arrived."""
    callback = {"callback_url": sender.url, "secret": SOURCE_SECRET}
    flow = Flow(tmp_path, receiver.url, receiver.status_url, **callback)
    flow.store.arrive("github", "m1", "ci", b"{}", time.time())
    return flow


def scripted(*replies: Reply) -> Script:
    """The replies in turn (the last one again once they run out), counting only the requests
    this script answers."""
    calls = iter(range(1 << 30))
    return lambda n, r: replies[min(next(calls), len(replies) - 1)]


class Flow:
    def __init__(self, tmp_path: Path, receiver_url: str, status_url: str, **source: Any) -> None:
        self.config = WebhooksConfig.model_validate(
            {
                "receivers": [
                    {
                        "name": "ci",
                        "url": receiver_url,
                        "status_url": status_url,
                        "secret": RECEIVER_SECRET,
                        "ttl_s": 30,
                    }
                ],
                "sources": [{"id": "github", **source}],
            }
        )
        self.store = SqliteState(tmp_path / "state.sqlite")
        self.responded: list[MessageState] = []

    def run(self, make: Callable[[Receiving], Awaitable[T]]) -> T:
        return run_steps(self.store, self.config, self.responded, make)

    def state(self) -> MessageState:
        state = self.store.get("github", "m1")
        assert state is not None
        return state


def test_an_async_result_is_polled_then_called_back(tmp_path: Path) -> None:
    results = scripted(Reply(202), Reply(503), Reply(200, b'{"build": "green"}'))
    with (
        running_receiver(RECEIVER_SECRET, scripted(Reply(202)), results) as receiver,
        running_receiver(SOURCE_SECRET, scripted(Reply(204))) as sender,
    ):
        flow = Flow(
            tmp_path,
            receiver.url,
            receiver.status_url,
            callback_url=sender.url,
            secret=SOURCE_SECRET,
        )
        flow.store.arrive("github", "m1", "ci", b'{"ref": "main"}', time.time())
        assert flow.run(lambda r: r.to_receiver("github", "m1")) is Step.PENDING
        assert flow.run(lambda r: poll(r, "github", "m1")) is Step.PENDING  # still 202
        assert flow.run(lambda r: poll(r, "github", "m1")) is Step.PENDING  # 503: try again
        assert flow.store.take_due(POLL, time.time() + 10, 10) == [("github", "m1")]
        assert flow.run(lambda r: poll(r, "github", "m1")) is Step.RESPONDED
        assert flow.state().response == b'{"build": "green"}'
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.DONE
        (callback,) = sender.posts()
    assert callback.verified  # signed with the source's secret
    assert json.loads(callback.body) == {
        "message_id": "m1",
        "receiver": "ci",
        "status": "RESPONSE_RECEIVED_FROM_RECEIVER",
        "response": {"build": "green"},
    }
    state = flow.state()
    assert state.status is Status.DONE
    assert [a.kind for a in state.attempts] == ["deliver", "poll", "poll", "poll", "callback"]


def test_no_result_within_the_ttl_fails(tmp_path: Path) -> None:
    with running_receiver(RECEIVER_SECRET, scripted(Reply(202)), scripted(Reply(202))) as receiver:
        flow = Flow(tmp_path, receiver.url, receiver.status_url)
        flow.store.arrive("github", "m1", "ci", b"{}", time.time())
        assert flow.run(lambda r: r.to_receiver("github", "m1")) is Step.PENDING
        later = time.time() + 3600  # an hour on: past the receiver's 30 s ttl

        async def late_poll(r: Receiving) -> Step:
            r.clock = lambda: later
            return await poll(r, "github", "m1")

        assert flow.run(late_poll) is Step.FAILED
    assert "ttl" in flow.state().reason


def test_a_failing_callback_is_retried_then_done(tmp_path: Path) -> None:
    with (
        running_receiver(RECEIVER_SECRET, scripted(Reply(200, b"not json"))) as receiver,
        running_receiver(SOURCE_SECRET, scripted(Reply(503), Reply(200))) as sender,
    ):
        flow = called_back(tmp_path, receiver, sender)
        assert flow.run(lambda r: r.to_receiver("github", "m1")) is Step.RESPONDED
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.SCHEDULED
        assert flow.store.take_due(CALLBACK, time.time() + 10, 10) == [("github", "m1")]
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.DONE
        assert json.loads(sender.posts()[-1].body)["response"] == {"text": "not json"}


def test_a_source_without_a_callback_is_done_at_once(tmp_path: Path) -> None:
    with running_receiver(RECEIVER_SECRET, scripted(Reply(200, b"{}"))) as receiver:
        flow = Flow(tmp_path, receiver.url, receiver.status_url)
        flow.store.arrive("github", "m1", "ci", b"{}", time.time())
        flow.run(lambda r: r.to_receiver("github", "m1"))
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.DONE
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.SKIPPED


def test_poll_backoff_and_the_callback_body() -> None:
    assert [next_poll_in(n) for n in (1, 2, 3, 4, 10)] == [1.0, 2.0, 4.0, 8.0, 60.0]
    state = MessageState("s", "m", "ci", Status.RESPONSE_RECEIVED_FROM_RECEIVER, b"", 0.0, 0.0)
    assert json.loads(callback_body(state)) == {
        "message_id": "m",
        "receiver": "ci",
        "status": "RESPONSE_RECEIVED_FROM_RECEIVER",
        "response": None,
    }
    # the receiver's JSON as it came (an integer past 64 bits exact), or its text
    for raw, response in (
        (b' {"n": 123456789012345678901234567890}\n', {"n": 123456789012345678901234567890}),
        (b"[1, 2]", [1, 2]),
        (b"not json \xff", {"text": "not json \ufffd"}),
    ):
        body = callback_body(replace(state, response=raw))
        assert json.loads(body)["response"] == response


async def _call_back(r: Receiving, state: MessageState) -> None:
    await to_sender(r, *state.key, state=state)


def in_place(from_topic: bool = False) -> Callable[[Receiving], Awaitable[Step]]:
    """The ToReceiver step of m1 as the workers run it: the callback made in place."""

    async def step(r: Receiving) -> Step:
        r.inline_callbacks = True
        r.respond = functools.partial(_call_back, r)
        return await r.to_receiver("github", "m1", from_topic)

    return step


def test_a_callback_made_in_place_is_recorded_with_the_response_in_one_step(
    tmp_path: Path,
) -> None:
    """While the callback is on its way nothing is recorded yet, and the send's claim covers
    it (another worker finds the message BUSY); then DONE, with every status passed through
    and both attempts."""
    other = SqliteState(tmp_path / "state.sqlite")  # another worker's
    seen: list[tuple[Status, Claim]] = []

    def on_callback(n: int, request: Any) -> Reply:
        state = other.get("github", "m1")
        assert state is not None
        seen.append((state.status, other.begin_send(state, time.time(), time.time() + 1)))
        return Reply(204)

    with (
        running_receiver(RECEIVER_SECRET, scripted(Reply(200, b'{"build": 1}'))) as receiver,
        running_receiver(SOURCE_SECRET, on_callback) as sender,
    ):
        flow = called_back(tmp_path, receiver, sender)
        assert flow.run(in_place()) is Step.RESPONDED
        assert len(sender.posts()) == 1
    assert seen == [(Status.ARRIVED, Claim.BUSY)]
    state = flow.state()
    assert (state.status, state.response) == (Status.DONE, b'{"build": 1}')
    assert [t.status for t in state.history] == [s for s in Status][:4]
    _, delivered, responded, done = (t.at for t in state.history)
    assert delivered == responded <= done
    assert [(a.kind, a.status_code) for a in state.attempts] == [
        ("deliver", 200),
        ("callback", 204),
    ]
    other.close()


def test_a_callback_made_in_place_that_fails_leaves_the_response_recorded(
    tmp_path: Path,
) -> None:
    with (
        running_receiver(RECEIVER_SECRET, scripted(Reply(200, b"{}"))) as receiver,
        running_receiver(SOURCE_SECRET, scripted(Reply(503), Reply(200))) as sender,
    ):
        flow = called_back(tmp_path, receiver, sender)
        assert flow.run(in_place()) is Step.RESPONDED
        state = flow.state()
        assert (state.status, state.response) == (Status.RESPONSE_RECEIVED_FROM_RECEIVER, b"{}")
        kinds = [(a.kind, a.status_code) for a in state.attempts]
        assert kinds == [("deliver", 200), ("callback", 503)]
        assert flow.store.take_due(CALLBACK, time.time() + 10, 10) == [("github", "m1")]
        assert flow.run(lambda r: to_sender(r, "github", "m1")) is Step.DONE  # claim ended
        assert len(sender.posts()) == 2


def test_a_send_claimed_with_the_arrival_is_not_claimed_again(tmp_path: Path) -> None:
    """The step in place sends under the claim its message arrived with; one whose claim is
    too near its end to cover the send asks the state, and finds it held."""
    with running_receiver(RECEIVER_SECRET, scripted(Reply(200, b"{}"))) as receiver:
        flow = Flow(tmp_path, receiver.url, receiver.status_url)
        now = time.time()
        batch = [("github", m, "ci", b"{}") for m in ("m1", "m2")]
        flow.store.arrive_many(batch, now, [now + 60, now + 1])
        asked: list[str] = []
        begin_send = flow.store.begin_send

        def spied(state: MessageState, now: float, until: float) -> Claim:
            asked.append(state.message_id)
            return begin_send(state, now, until)

        flow.store.begin_send = spied  # type: ignore[method-assign]

        async def claimed(r: Receiving, message_id: str, until: float) -> Step:
            r.arrival_claims([(("github", message_id), until)])
            return await r.to_receiver("github", message_id, from_topic=True)

        assert flow.run(lambda r: claimed(r, "m1", now + 60)) is Step.RESPONDED
        assert flow.run(lambda r: claimed(r, "m2", now + 1)) is Step.SKIPPED  # BUSY: its own
        assert asked == ["m2"]
        assert [p.message_id for p in receiver.posts()] == ["m1"]
