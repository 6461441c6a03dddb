"""The webhook topics on headwater's bus (seed 004) and the FromSender step: a message from
``from_sender`` is deduplicated and recorded in the state, then routed to its receiver's topic.

Topics: ``webhooks.from_sender`` (keyed by source and receiver: a source's messages to a
receiver stay in order, and the receivers of a source spread over the partitions),
``webhooks.to_receiver.<receiver>`` and ``webhooks.pending_from_receiver.<receiver>`` (one
partition each: per-receiver order and limits), ``webhooks.to_sender``, and
``webhooks.failed_messages``. A record's value is the sender's payload as it came (on
``to_sender``: the receiver's response); the source, the message id, the receiver and, on
``failed_messages``, the reason travel in headers (:class:`WebhookMessage`); its key is the
source id and the receiver's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headwater.bus.records import Message
from headwater.errors import TerminalError
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.state.base import LoopState, MessageState, Status


@dataclass(frozen=True)
class Topics:
    """The topic names, under a prefix (``webhooks.topic_prefix``, default ``webhooks.``)."""

    prefix: str = "webhooks."

    @property
    def from_sender(self) -> str:
        return f"{self.prefix}from_sender"

    @property
    def to_sender(self) -> str:
        return f"{self.prefix}to_sender"

    @property
    def failed_messages(self) -> str:
        return f"{self.prefix}failed_messages"

    def to_receiver(self, receiver: str) -> str:
        return f"{self.prefix}to_receiver.{receiver}"

    def pending_from_receiver(self, receiver: str) -> str:
        return f"{self.prefix}pending_from_receiver.{receiver}"

    def group(self, worker: str) -> str:
        """The consumer group of a worker (``headwater-webhooks.from_sender``)."""
        return f"headwater-{self.prefix}{worker}"


DEFAULT = Topics()
FROM_SENDER = DEFAULT.from_sender
TO_SENDER = DEFAULT.to_sender
FAILED_MESSAGES = DEFAULT.failed_messages
to_receiver = DEFAULT.to_receiver
pending_from_receiver = DEFAULT.pending_from_receiver


SOURCE_HEADER, MESSAGE_HEADER, RECEIVER_HEADER, REASON_HEADER = (
    "hw-webhook-source",
    "hw-webhook-id",
    "hw-webhook-receiver",
    "hw-webhook-reason",
)


class BadMessage(TerminalError):
    """A record on a webhook topic that is not a webhook message."""

    code = "HW-WH-201"


@dataclass(frozen=True)
class WebhookMessage:
    source_id: str
    message_id: str
    receiver: str
    payload: bytes  # the sender's JSON payload, as sent
    reason: str = ""  # on failed_messages: why

    @property
    def key(self) -> bytes:
        """The source id and the receiver (NUL between): ``from_sender`` is partitioned by
        them, so a source's messages to a receiver keep their order (the other topics have one
        partition, or order by receiver), and the FromSender steps, which take a receiver's
        steps on in place, spread a source's receivers over the worker processes."""
        return f"{self.source_id}\0{self.receiver}".encode()

    def to_message(self) -> Message:
        """The record: the payload as the value, untouched; the rest in headers."""
        headers = [
            (SOURCE_HEADER, self.source_id.encode()),
            (MESSAGE_HEADER, self.message_id.encode()),
            (RECEIVER_HEADER, self.receiver.encode()),
        ]
        if self.reason:
            headers.append((REASON_HEADER, self.reason.encode()))
        return Message(self.payload, key=self.key, headers=tuple(headers))

    @classmethod
    def from_record(cls, value: bytes, headers: Sequence[tuple[str, bytes]]) -> WebhookMessage:
        fields = dict(headers)
        try:
            return cls(
                source_id=fields[SOURCE_HEADER].decode(),
                message_id=fields[MESSAGE_HEADER].decode(),
                receiver=fields[RECEIVER_HEADER].decode(),
                payload=value,
                reason=fields.get(REASON_HEADER, b"").decode(),
            )
        except (KeyError, UnicodeDecodeError) as e:
            raise BadMessage(f"not a webhook message ({type(e).__name__}: {e})") from None


async def from_sender(
    state: LoopState, config: WebhooksConfig, message: WebhookMessage, now: float
) -> list[tuple[str, Message]]:
    """Dedup, record, route: what to append where (nothing for a message already known: the
    sender sent it again, or this step ran before a crash and its record was read again; it is
    routed again only while it is still ARRIVED, since the routing may not have been appended)."""
    routed = await from_senders(state, config, [message], now)
    return [(topic, out.to_message()) for topic, out in routed]


async def from_senders(
    state: LoopState,
    config: WebhooksConfig,
    messages: list[WebhookMessage],
    now: float,
    recorded: list[MessageState] | None = None,
    claims: Sequence[float | None] | None = None,
) -> list[tuple[str, WebhookMessage]]:
    """``from_sender`` for a batch of messages, recorded in one step of the state, each routed
    message with its topic (not encoded yet: the workers take some on in place); the messages
    it recorded, as recorded, appended to ``recorded``; ``claims``: the first send of each
    message recorded claimed until then (None: not; see ``StateStore.arrive_many``)."""
    arrived = await state.arrive_many(
        [(m.source_id, m.message_id, m.receiver, m.payload) for m in messages], now, claims
    )
    topics = Topics(config.topic_prefix)
    out: list[tuple[str, WebhookMessage]] = []
    for created, known in arrived:
        if not created and known.status is not Status.ARRIVED:
            continue
        # what was recorded first is what is delivered, whatever a repeat carries
        message = WebhookMessage(known.source_id, known.message_id, known.receiver, known.payload)
        if config.receiver(message.receiver) is None:
            reason = f"no receiver named {message.receiver!r} is configured"
            await state.move(known, Status.FAILED, now, reason=reason)
            failed = WebhookMessage(*known.key, message.receiver, message.payload, reason)
            out.append((topics.failed_messages, failed))
        else:
            out.append((topics.to_receiver(message.receiver), message))
            if created and recorded is not None:
                recorded.append(known)
    return out
