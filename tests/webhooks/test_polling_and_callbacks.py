"""The asynchronous result and the way back, against real local servers and the embedded
state: a receiver that accepts and answers later is polled until its result arrives (or the
ttl passes), and the result is POSTed, signed with the source's secret, to the sender's
callback; a callback that fails is retried on the schedule; a source with no callback is DONE
at once."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from headwater.testing.webhooks import Reply, Script, run_steps, running_receiver
from headwater.webhooks.callbacks import callback_body, to_sender
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.polling import next_poll_in, poll
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.state import MessageState, Status
from headwater.webhooks.state.base import CALLBACK, POLL
from headwater.webhooks.state.sqlite import SqliteState

RECEIVER_SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
SOURCE_SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
T = TypeVar("T")


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
        callback = {"callback_url": sender.url, "secret": SOURCE_SECRET}
        flow = Flow(tmp_path, receiver.url, receiver.status_url, **callback)
        flow.store.arrive("github", "m1", "ci", b"{}", time.time())
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
