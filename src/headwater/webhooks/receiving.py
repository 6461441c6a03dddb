"""The ToReceiver step (seed 004's ToReceiverWorker, for one message): take the receiver's rate
limit, deliver, record the attempt, and move the message on by what the answer means:

- a sync result: DELIVERED_TO_RECEIVER, then RESPONSE_RECEIVED_FROM_RECEIVER with the result,
  handed to ``to_sender`` (the callback to the sender);
- accepted for later: DELIVERED_TO_RECEIVER and a poll scheduled (``status_url``); a receiver
  with no ``status_url`` has no result to give: its acceptance is the response;
- transient: the next attempt goes on the state's ``deliver`` schedule (no worker sleeps on
  it); when the schedule is spent, FAILED;
- gone (410) or terminal: FAILED with the reason.

Before sending again after an ambiguous failure (no answer: the request may have arrived), a
receiver with a ``status_url`` is asked first: 404 means send; a known message is not sent
again (its result, when there is one, is taken as the response). A message that is no longer
ARRIVED (another worker, or a run before a crash, got further) is left alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp

from headwater.webhooks.config import ReceiverConfig, WebhooksConfig
from headwater.webhooks.delivery import Outcome, Verdict, ask_status, deliver, next_attempt_at
from headwater.webhooks.signing import Signer
from headwater.webhooks.state.base import InvalidTransition, MessageState, StateStore, Status

DELIVER, POLL, CALLBACK = "deliver", "poll", "callback"  # the state's schedules
FIRST_POLL_S = 1.0


class Step(StrEnum):
    RESPONDED = "responded"  # a response is on its way to the sender
    PENDING = "pending"  # accepted: a poll is scheduled
    SCHEDULED = "scheduled"  # a retry is scheduled
    DONE = "done"  # the response reached the sender (or the sender wants none)
    FAILED = "failed"
    SKIPPED = "skipped"  # not in the status the step works on (anymore), or unknown


@dataclass
class Receiving:
    """What the step needs: the state, the config, an HTTP session, and where responses go
    (``respond(state)``: appends to ``to_sender``)."""

    store: StateStore
    config: WebhooksConfig
    session: aiohttp.ClientSession
    respond: Callable[[MessageState], Awaitable[None]]
    clock: Callable[[], float] = time.time
    _signers: dict[tuple[str, ...], Signer] = field(default_factory=dict)

    def signer(self, endpoint: ReceiverConfig) -> Signer:
        """The signer of a receiver (or of a sender's callback), made once per set of secrets."""
        secrets = tuple(endpoint.secret)
        signer = self._signers.get(secrets)
        if signer is None:
            signer = self._signers[secrets] = Signer.from_secrets(secrets)
        return signer

    async def rate_limited(self, receiver: ReceiverConfig) -> None:
        """Wait until the receiver's rate limit lets one more request through."""
        limit = receiver.rate_limit
        if limit is None:
            return
        while (wait := self.store.acquire(receiver.name, limit.requests, limit.per_s)) > 0:
            await asyncio.sleep(wait)

    async def to_receiver(self, source_id: str, message_id: str) -> Step:
        state = self.store.get(source_id, message_id)
        if state is None or state.status is not Status.ARRIVED:
            return Step.SKIPPED
        receiver = self.config.receiver(state.receiver)
        if receiver is None:
            return self.fail(state, f"no receiver named {state.receiver!r} is configured")
        signer = self.signer(receiver)
        if _last_was_ambiguous(state) and receiver.status_url is not None:
            known = await ask_status(self.session, receiver, signer, message_id)
            self.store.record_attempt(source_id, message_id, known.attempt)
            if known.verdict in (Verdict.RESULT, Verdict.ACCEPTED):  # it did arrive
                return await self._settle(state, receiver, known)
            if known.attempt.status_code != 404:  # cannot tell yet: ask again later
                return self._retry(state, receiver, known)
        await self.rate_limited(receiver)
        outcome = await deliver(self.session, receiver, signer, message_id, state.payload)
        self.store.record_attempt(source_id, message_id, outcome.attempt)
        return await self._settle(state, receiver, outcome)

    async def _settle(
        self, state: MessageState, receiver: ReceiverConfig, outcome: Outcome
    ) -> Step:
        now = self.clock()
        try:
            if outcome.verdict is Verdict.RESULT or (
                outcome.verdict is Verdict.ACCEPTED and receiver.status_url is None
            ):
                self.store.advance(*state.key, Status.DELIVERED_TO_RECEIVER, now)
                response = outcome.body or _accepted(outcome)
                done = self.store.advance(
                    *state.key, Status.RESPONSE_RECEIVED_FROM_RECEIVER, now, response=response
                )
                await self.respond(done)
                return Step.RESPONDED
            if outcome.verdict is Verdict.ACCEPTED:
                self.store.advance(*state.key, Status.DELIVERED_TO_RECEIVER, now)
                self.store.schedule(POLL, *state.key, now + FIRST_POLL_S)
                return Step.PENDING
        except InvalidTransition:
            return Step.SKIPPED  # another worker moved it first
        if outcome.verdict is Verdict.RETRY:
            return self._retry(state, receiver, outcome)
        if outcome.verdict is Verdict.GONE:
            return self.fail(state, f"the receiver {receiver.name} is gone: {outcome.reason}")
        return self.fail(state, outcome.reason)

    def _retry(self, state: MessageState, receiver: ReceiverConfig, outcome: Outcome) -> Step:
        now = self.clock()
        tries = state.tries("deliver") + (1 if outcome.attempt.kind == "deliver" else 0)
        at = next_attempt_at(receiver, tries, now, outcome.retry_after_s)
        if at is None:
            return self.fail(state, f"gave up after {tries} attempts: {outcome.reason}")
        self.store.schedule(DELIVER, *state.key, at)
        return Step.SCHEDULED

    def fail(self, state: MessageState, reason: str) -> Step:
        """FAILED with ``reason`` (SKIPPED when another worker moved the message first)."""
        try:
            self.store.advance(*state.key, Status.FAILED, self.clock(), reason=reason)
        except InvalidTransition:
            return Step.SKIPPED
        return Step.FAILED


def _last_was_ambiguous(state: MessageState) -> bool:
    delivers = [a for a in state.attempts if a.kind == "deliver"]
    return bool(delivers) and delivers[-1].status_code is None


def _accepted(outcome: Outcome) -> bytes:
    """The response of a receiver that accepted with nothing to say."""
    return json.dumps({"status": outcome.attempt.status_code}).encode()
