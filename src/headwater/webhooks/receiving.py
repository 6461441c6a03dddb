"""The ToReceiver step (seed 004's ToReceiverWorker, for one message): take the receiver's rate
limit, claim the send, deliver, record the attempt, and move the message on by what the answer
means:

- a sync result: DELIVERED_TO_RECEIVER and RESPONSE_RECEIVED_FROM_RECEIVER with the result (one
  atomic step), handed to ``respond`` (the ``to_sender`` topic: the callback to the sender);
- accepted for later: DELIVERED_TO_RECEIVER, handed to ``pending`` (the
  ``pending_from_receiver`` topic, whose worker schedules the polls of ``status_url``); a
  receiver with no ``status_url`` has no result to give: its acceptance is the response;
- transient: the next attempt goes on the state's ``deliver`` schedule (no worker sleeps on
  it); when the schedule is spent, FAILED;
- gone (410): the receiver is disabled and the message FAILED; terminal: FAILED with the reason.

A send is claimed in the state first (``begin_send``, or with the message's arrival when
FromSender runs its step in place: ``arrival_claims``): another worker never sends the same
message at the same time, and a send whose worker died before recording the answer is known.
When the callback is made in place (``inline_callbacks``), the claim covers it too, and the
response is recorded with the callback's outcome, in one step (``finish``): DONE, or, when the
callback is to be retried, RESPONSE_RECEIVED_FROM_RECEIVER (``record_response``). A worker that
dies between the receiver's answer and that step leaves the send's claim: the message is sent
again once it runs out (after asking ``status_url``, where there is one), as after a worker that
died waiting for the answer.
Before sending again after such an ambiguous failure (the request may have arrived), a receiver
with a ``status_url`` is asked first: 404 means send; a known message is not sent again (its
result, when there is one, is taken as the response).

The step may run again for a message it already handled (its record is read again after a
crash, or a stale schedule entry fires): a message past ARRIVED has its hand-off (``pending``,
``respond``) done again, which the next steps take at most once; DONE and FAILED are left alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from headwater.http.client import HttpClient
from headwater.webhooks.config import (
    SVIX_RETRY_SCHEDULE_S,
    ReceiverConfig,
    WebhooksConfig,
    WebhookSourceConfig,
)
from headwater.webhooks.delivery import (
    JITTER,
    Outcome,
    Verdict,
    ask_status,
    deliver,
    next_attempt_at,
)
from headwater.webhooks.signing import Signer
from headwater.webhooks.state.base import (
    DELIVER,
    POLL,
    Attempt,
    Claim,
    InvalidTransition,
    LoopState,
    MessageState,
    StateStore,
    Status,
)

FIRST_POLL_S = 1.0
SEND_GRACE_S = 5.0  # a send's claim outlives its timeout by this much
DISABLED_RECHECK_S = 30.0  # a scheduled retry for a disabled receiver waits this long again
# messages just recorded, kept for their ToReceiver step: at most this many, of this many bytes
REMEMBERED, REMEMBERED_BYTES = 10_000, 16 << 20

Hook = Callable[[MessageState], Awaitable[None]]


class Step(StrEnum):
    RESPONDED = "responded"  # a response is on its way to the sender
    PENDING = "pending"  # accepted: a poll is scheduled
    SCHEDULED = "scheduled"  # a retry is scheduled
    DONE = "done"  # the response reached the sender (or the sender wants none)
    FAILED = "failed"
    SKIPPED = "skipped"  # not in the status the step works on (anymore), or unknown


@dataclass
class Receiving:
    """What the steps need: the state, the config, an HTTP session, and the hand-offs to the
    next steps: ``respond`` (a response for the sender: ``to_sender``), ``pending`` (a result
    to poll for: ``pending_from_receiver``; by default the first poll is scheduled at once) and
    ``failed`` (``failed_messages``; by default nothing)."""

    store: StateStore
    config: WebhooksConfig
    session: HttpClient
    respond: Hook
    pending: Hook | None = None
    failed: Hook | None = None
    clock: Callable[[], float] = time.time
    state: LoopState = field(default=None)  # type: ignore[assignment]  # the store's by default
    # messages this process just recorded, as recorded, until their ToReceiver step takes them
    # (instead of reading each again): see ``remember``
    arrived: dict[tuple[str, str], MessageState] = field(default_factory=dict)
    _remembered_bytes: int = 0
    # ``respond`` calls the sender back in place (the workers' does, but for ordered receivers):
    # the send's claim then covers the callback, and the response is recorded with its outcome
    inline_callbacks: bool = False
    # claims made with the messages' arrival (until when), for their steps in place
    _claimed: dict[tuple[str, str], float] = field(default_factory=dict)
    # responses got and not recorded yet, with their callbacks in flight: the message as the
    # step read it, when the response came and the delivery's attempt (see ``finish``)
    _unrecorded: dict[tuple[str, str], tuple[MessageState, float, Attempt]] = field(
        default_factory=dict
    )
    _signers: dict[tuple[str, ...], Signer] = field(default_factory=dict)
    _callbacks: dict[str, ReceiverConfig] = field(default_factory=dict)
    _disabled: tuple[float, frozenset[str]] = (0.0, frozenset())

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = self.store.on_loop()

    def remember(self, states: Sequence[MessageState]) -> None:
        """Keep messages just recorded as ARRIVED for their ToReceiver step, the oldest
        forgotten past ``REMEMBERED`` (or their payloads past ``REMEMBERED_BYTES``: a message
        whose step runs in another process is never taken). A step that finds one changed
        since, its claim MOVED, reads it."""
        for state in states:
            self.arrived[state.key] = state
            self._remembered_bytes += len(state.payload)
        while self.arrived and (
            len(self.arrived) > REMEMBERED or self._remembered_bytes > REMEMBERED_BYTES
        ):
            oldest = next(iter(self.arrived))
            self._remembered_bytes -= len(self.arrived.pop(oldest).payload)

    def recall(self, key: tuple[str, str]) -> MessageState | None:
        """A message ``remember``ed, forgotten as it is taken."""
        state = self.arrived.pop(key, None)
        if state is not None:
            self._remembered_bytes -= len(state.payload)
        return state

    def calls_back_inline(self, state: MessageState) -> bool:
        """Whether ``respond`` makes the callback of this message in place."""
        receiver = self.config.receiver(state.receiver)
        return self.inline_callbacks and receiver is not None and not receiver.ordered

    def claim_until(self, receiver: ReceiverConfig, source_id: str, now: float) -> float:
        """Until when a send to ``receiver`` begun ``now`` is claimed: its timeout, the
        callback's too when ``respond`` makes it in place, and ``SEND_GRACE_S``."""
        until = now + receiver.timeout_s + SEND_GRACE_S
        if self.inline_callbacks and not receiver.ordered:
            source = self.config.source(source_id)
            if source is not None and source.callback_url is not None:
                until += self.callback_endpoint(source).timeout_s
        return until

    def arrival_claims(self, claims: Sequence[tuple[tuple[str, str], float]]) -> None:
        """Messages whose first send was claimed with their arrival (``arrive_many``), until
        when: their step in place sends without claiming (``forget_claim`` once it ran)."""
        self._claimed.update(claims)

    def forget_claim(self, key: tuple[str, str]) -> None:
        self._claimed.pop(key, None)

    def unrecorded(self, state: MessageState) -> bool:
        """Whether the step that got this message's response left it to be recorded with the
        callback's outcome (``finish``); its send's claim covers the callback."""
        return state.key in self._unrecorded

    async def finish(self, state: MessageState, attempt: Attempt | None = None) -> None:
        """DONE, with the callback's ``attempt``: and with the response, in the same step of
        the state, when the step that got it left it unrecorded. InvalidTransition when
        another worker moved the message first."""
        if not await self._record_left(state, Status.DONE, attempt):
            await self.state.move(state, Status.DONE, self.clock(), attempt=attempt)

    async def record_response(self, state: MessageState) -> None:
        """Record the response the step that got it left unrecorded (its callback did not
        succeed), as that step would have."""
        await self._record_left(state, Status.RESPONSE_RECEIVED_FROM_RECEIVER)

    async def _record_left(
        self, state: MessageState, status: Status, attempt: Attempt | None = None
    ) -> bool:
        """Record the response the step that got it left unrecorded, the message moving on to
        ``status`` (DONE now, with the callback's ``attempt``; or RESPONSE_RECEIVED_FROM_RECEIVER
        as of when the response came); False when nothing was left."""
        left = self._unrecorded.pop(state.key, None)
        if left is None:
            return False
        read, at, delivered = left
        via: tuple[Status, ...] = (Status.DELIVERED_TO_RECEIVER,)
        if status is Status.DONE:
            via += (Status.RESPONSE_RECEIVED_FROM_RECEIVER,)
        await self.state.move(
            read,
            status,
            self.clock() if status is Status.DONE else at,
            response=state.response,
            via=via,
            via_at=at,
            attempt=delivered if attempt is None else (delivered, attempt),
        )
        return True

    def signer(self, endpoint: ReceiverConfig) -> Signer:
        """The signer of a receiver (or of a sender's callback), made once per set of secrets."""
        secrets = tuple(endpoint.secret)
        signer = self._signers.get(secrets)
        if signer is None:
            signer = self._signers[secrets] = Signer.from_secrets(secrets)
        return signer

    def callback_endpoint(self, source: WebhookSourceConfig) -> ReceiverConfig:
        """A sender's callback as a receiver-shaped endpoint (its URL, secrets, timeout and
        Svix's retries) for delivery, made once per source."""
        endpoint = self._callbacks.get(source.id)
        if endpoint is None:
            endpoint = self._callbacks[source.id] = ReceiverConfig(
                name=f"callback.{source.id}",
                url=source.callback_url or "",
                secret=source.secret,
                retry_schedule_s=list(SVIX_RETRY_SCHEDULE_S),
            )
        return endpoint

    async def rate_limited(self, receiver: ReceiverConfig) -> None:
        """Wait until the receiver's rate limit lets one more request through."""
        limit = receiver.rate_limit
        if limit is None:
            return
        while (wait := await self.state.acquire(receiver.name, limit.requests, limit.per_s)) > 0:
            await asyncio.sleep(wait)

    def disabled(self, name: str) -> bool:
        """Whether the receiver is disabled (the state's flags, looked up once a second)."""
        at, names = self._disabled
        now = time.monotonic()
        if now - at > 1.0:
            names = frozenset(n for n, r in self.store.receivers().items() if r.disabled)
            self._disabled = (now, names)
        return name in names

    async def schedule_poll(self, state: MessageState) -> None:
        """Schedule the first poll of a message delivered for a later result."""
        delivered = state.last(Status.DELIVERED_TO_RECEIVER) or self.clock()
        await self.state.schedule(POLL, *state.key, delivered + FIRST_POLL_S)

    async def to_receiver(self, source_id: str, message_id: str, from_topic: bool = False) -> Step:
        """The step for one message; ``from_topic``: run for a record of the topic (which may
        be a repeat), not for its entry on the schedule, so a retry that is not due yet waits
        for it."""
        state = self.recall((source_id, message_id)) if from_topic else None
        recalled = state is not None
        if state is None:
            state = await self.state.get(source_id, message_id)
        if state is None:
            return Step.SKIPPED
        if state.status is not Status.ARRIVED:
            return await self.hand_on(state)
        receiver = self.config.receiver(state.receiver)
        if receiver is None:
            return await self.fail(state, f"no receiver named {state.receiver!r} is configured")
        if self.disabled(receiver.name):
            await self.state.schedule(DELIVER, *state.key, self.clock() + DISABLED_RECHECK_S)
            return Step.SCHEDULED
        schedule = receiver.retry_schedule_s
        due = not_before(state, DELIVER, schedule, self.clock()) if from_topic else None
        if due is not None:  # a repeated record before the retry is due
            await self.state.schedule(DELIVER, *state.key, due)
            return Step.SCHEDULED
        signer = self.signer(receiver)
        await self.rate_limited(receiver)
        until = self._claimed.pop(state.key, None)
        if until is not None and until > self.clock() + receiver.timeout_s:
            claim = Claim.CLAIMED  # with its arrival, and no attempt can have been made since
        else:
            claim = await self._claim(state, receiver)
        if claim is Claim.MOVED and recalled:  # changed since it arrived here: read it
            return await self.to_receiver(source_id, message_id, from_topic)
        if claim in (Claim.BUSY, Claim.MOVED):  # another worker is sending it, or acted on it
            return await self.recheck(state, DELIVER, receiver.timeout_s)
        ambiguous = claim is Claim.INTERRUPTED or _last_was_ambiguous(state)
        if ambiguous and receiver.status_url is not None:
            known = await ask_status(self.session, receiver, signer, message_id)
            if known.verdict in (Verdict.RESULT, Verdict.ACCEPTED):  # it did arrive
                return await self._settle(state, receiver, known)
            await self.state.record_attempt(source_id, message_id, known.attempt)
            if known.attempt.status_code != 404:  # cannot tell yet: ask again later
                return await self._retry(state, receiver, known)
            await self.rate_limited(receiver)
            asked = replace(state, attempts=(*state.attempts, known.attempt))
            if await self._claim(asked, receiver) is not Claim.CLAIMED:
                return await self.recheck(state, DELIVER, receiver.timeout_s)
        outcome = await deliver(self.session, receiver, signer, message_id, state.payload)
        return await self._settle(state, receiver, outcome)

    async def recheck(self, state: MessageState, kind: str, timeout_s: float) -> Step:
        """Another worker holds the message (or just acted on it): look again once its claim
        would have run out, for if that worker died, nothing else would (the record that
        brought the message here is committed)."""
        await self.state.schedule(kind, *state.key, self.clock() + timeout_s + SEND_GRACE_S + 1.0)
        return Step.SKIPPED

    async def _claim(self, state: MessageState, receiver: ReceiverConfig) -> Claim:
        now = self.clock()
        until = self.claim_until(receiver, state.source_id, now)
        return await self.state.begin_send(state, now, until)

    async def hand_on(self, state: MessageState) -> Step:
        """Hand a message past ARRIVED on again (its step ran before, and may have stopped
        between its state change and its hand-off)."""
        if state.status is Status.DELIVERED_TO_RECEIVER:
            await (self.pending or self.schedule_poll)(state)
            return Step.PENDING
        if state.status is Status.RESPONSE_RECEIVED_FROM_RECEIVER:
            await self.respond(state)
            return Step.RESPONDED
        return Step.SKIPPED

    async def _settle(
        self, state: MessageState, receiver: ReceiverConfig, outcome: Outcome
    ) -> Step:
        """Record the outcome's attempt (with the status change it brings, in one step) and
        move the message on."""
        now = self.clock()
        attempt = outcome.attempt
        try:
            if outcome.verdict is Verdict.RESULT or (
                outcome.verdict is Verdict.ACCEPTED and receiver.status_url is None
            ):
                response = outcome.body or _accepted(outcome)
                via = Status.DELIVERED_TO_RECEIVER
                if not self.calls_back_inline(state):
                    responded = await self.state.move(
                        state, Status.RESPONSE_RECEIVED_FROM_RECEIVER, now, response=response,
                        via=via, attempt=attempt,
                    )  # fmt: skip
                    await self.respond(responded)
                    return Step.RESPONDED
                # recorded with the callback's outcome (``finish``, ``record_response``)
                responded = state.moved(
                    Status.RESPONSE_RECEIVED_FROM_RECEIVER, now, response=response, via=via,
                    attempt=attempt,
                )  # fmt: skip
                self._unrecorded[state.key] = (state, now, attempt)
                try:
                    await self.respond(responded)
                finally:
                    self._unrecorded.pop(state.key, None)
                return Step.RESPONDED
            if outcome.verdict is Verdict.ACCEPTED:
                delivered = await self.state.move(
                    state, Status.DELIVERED_TO_RECEIVER, now, attempt=attempt
                )
                await (self.pending or self.schedule_poll)(delivered)
                return Step.PENDING
        except InvalidTransition:
            await self.state.record_attempt(*state.key, attempt)
            return Step.SKIPPED  # another worker moved it first
        await self.state.record_attempt(*state.key, attempt)
        if outcome.verdict is Verdict.RETRY:
            return await self._retry(state, receiver, outcome)
        if outcome.verdict is Verdict.GONE:
            reason = f"the receiver {receiver.name} is gone: {outcome.reason}"
            self.store.set_receiver(receiver.name, True, reason, now)
            self._disabled = (0.0, frozenset())
            return await self.fail(state, reason)
        return await self.fail(state, outcome.reason)

    async def _retry(self, state: MessageState, receiver: ReceiverConfig, outcome: Outcome) -> Step:
        now = self.clock()
        tries = state.tries(DELIVER) + (1 if outcome.attempt.kind == DELIVER else 0)
        at = next_attempt_at(receiver, tries, now, outcome.retry_after_s)
        if at is None:
            return await self.fail(state, f"gave up after {tries} attempts: {outcome.reason}")
        await self.state.schedule(DELIVER, *state.key, at)
        return Step.SCHEDULED

    async def fail(self, state: MessageState, reason: str) -> Step:
        """FAILED with ``reason``, handed to ``failed`` (SKIPPED when another worker moved the
        message first)."""
        try:
            failed = await self.state.move(state, Status.FAILED, self.clock(), reason=reason)
        except InvalidTransition:
            return Step.SKIPPED
        if self.failed is not None:
            await self.failed(failed)
        return Step.FAILED


def not_before(
    state: MessageState, kind: str, schedule: Sequence[float], now: float
) -> float | None:
    """When the next try of ``kind`` is due, if that is still to come: the last failed try of
    the message's current stage plus its wait on ``schedule`` (at the low end of the jitter),
    so that a step run early (a repeated record, a re-check) does not retry sooner than the
    schedule says. None: try now."""
    since = state.history[-1].at if state.history else 0.0
    tried = [a for a in state.attempts if a.kind == kind and a.at >= since]
    if not tried or len(tried) > len(schedule):
        return None
    due = tried[-1].at + schedule[len(tried) - 1] * (1 - JITTER)
    return due if due > now else None


def _last_was_ambiguous(state: MessageState) -> bool:
    delivers = [a for a in state.attempts if a.kind == DELIVER]
    return bool(delivers) and delivers[-1].status_code is None


def _accepted(outcome: Outcome) -> bytes:
    """The response of a receiver that accepted with nothing to say."""
    return json.dumps({"status": outcome.attempt.status_code}).encode()
