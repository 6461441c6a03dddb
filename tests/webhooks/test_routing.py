"""The FromSender step and the webhook topics: a message is recorded once and routed to its
receiver's topic; the same message again is not routed again once it moved on; a message for
an unknown receiver fails with a reason and goes to failed_messages; records that are not
webhook messages are named as such."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from headwater.bus.names import check_topic_name
from headwater.bus.records import Message
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.routing import (
    FAILED_MESSAGES,
    FROM_SENDER,
    TO_SENDER,
    BadMessage,
    WebhookMessage,
    from_sender,
    pending_from_receiver,
    to_receiver,
)
from headwater.webhooks.state import StateStore, Status
from headwater.webhooks.state.sqlite import SqliteState

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
CONFIG = WebhooksConfig.model_validate(
    {"receivers": [{"name": "ci", "url": "http://127.0.0.1:9/hooks", "secret": SECRET}]}
)


def _route(
    store: StateStore, config: WebhooksConfig, message: WebhookMessage, now: float
) -> list[tuple[str, Message]]:
    return asyncio.run(from_sender(store.on_loop(), config, message, now))


def test_recorded_once_routed_while_still_arrived(tmp_path: Path) -> None:
    store = SqliteState(tmp_path / "s.sqlite")
    message = WebhookMessage("github", "m1", "ci", b'{"ref": "main"}')
    (routed,) = _route(store, CONFIG, message, 1.0)
    assert routed[0] == "webhooks.to_receiver.ci"
    assert WebhookMessage.from_record(routed[1].value, routed[1].headers) == message
    assert routed[1].key == b"github\0ci"  # partitioned by source and receiver
    # read again before its routing was committed: routed again, as first recorded (the
    # receiver's step delivers only an ARRIVED message)
    repeat = WebhookMessage("github", "m1", "ci", b'{"ref": "other"}')
    ((_, again),) = _route(store, CONFIG, repeat, 2.0)
    assert WebhookMessage.from_record(again.value, again.headers) == message
    store.advance("github", "m1", Status.DELIVERED_TO_RECEIVER, 3.0)
    assert _route(store, CONFIG, message, 4.0) == []  # sent again by the sender: dropped
    state = store.get("github", "m1")
    assert state is not None and state.created_at == 1.0


def test_an_unknown_receiver_fails_with_a_reason(tmp_path: Path) -> None:
    store = SqliteState(tmp_path / "s.sqlite")
    message = WebhookMessage("github", "m2", "nobody", b"{}")
    ((topic, record),) = _route(store, CONFIG, message, 1.0)
    assert topic == FAILED_MESSAGES
    assert (
        "no receiver named 'nobody'"
        in WebhookMessage.from_record(record.value, record.headers).reason
    )
    state = store.get("github", "m2")
    assert state is not None and state.status is Status.FAILED


@pytest.mark.parametrize(
    "headers",
    [(), (("hw-webhook-source", b"s"),), (("hw-webhook-id", b"\xff"), ("hw-webhook-source", b"s"))],
)
def test_records_that_are_not_webhook_messages(headers: tuple[tuple[str, bytes], ...]) -> None:
    with pytest.raises(BadMessage, match="not a webhook message"):
        WebhookMessage.from_record(b"{}", headers)


def test_topic_names_are_valid_on_the_bus() -> None:
    for name in (
        FROM_SENDER,
        TO_SENDER,
        FAILED_MESSAGES,
        to_receiver("ci.eu-1"),
        pending_from_receiver("ci_2"),
    ):
        assert check_topic_name(name) == name
