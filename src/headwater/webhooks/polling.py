"""The FromReceiverAsync step (seed 004's poller, for one message): a message the receiver
accepted without a result is DELIVERED_TO_RECEIVER with a poll on the state's schedule; each
poll asks the receiver's ``status_url``:

- a result (2xx with a body): RESPONSE_RECEIVED_FROM_RECEIVER, handed to the sender;
- still pending (202, no body), no answer, 429/5xx: the next poll, backing off (1 s doubling to
  a minute) until ``ttl_s`` after the delivery, then FAILED;
- 404 or another answer: FAILED (the receiver no longer knows the message).
"""

from __future__ import annotations

from dataclasses import replace

from headwater.webhooks.delivery import Verdict, ask_status
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.state.base import POLL, InvalidTransition, MessageState, Status

MAX_POLL_INTERVAL_S = 60.0


def next_poll_in(polls: int) -> float:
    """Seconds to the next poll after ``polls`` polls: 1, 2, 4, ... up to a minute."""
    return float(min(MAX_POLL_INTERVAL_S, 2 ** max(0, polls - 1)))


def delivered_at(state: MessageState) -> float:
    """When the message was (last) delivered: a retried poll has its ttl again."""
    return state.last(Status.DELIVERED_TO_RECEIVER) or state.created_at


async def poll(ctx: Receiving, source_id: str, message_id: str) -> Step:
    state = await ctx.state.get(source_id, message_id)
    if state is None or state.status is not Status.DELIVERED_TO_RECEIVER:
        return Step.SKIPPED
    receiver = ctx.config.receiver(state.receiver)
    if receiver is None or receiver.status_url is None:
        return await ctx.fail(state, f"receiver {state.receiver!r} has no status_url to poll")
    outcome = await ask_status(ctx.session, receiver, ctx.signer(receiver), message_id)
    await ctx.state.record_attempt(source_id, message_id, outcome.attempt)
    now = ctx.clock()
    if outcome.verdict is Verdict.RESULT:
        try:
            polled = replace(state, attempts=(*state.attempts, outcome.attempt))
            done = await ctx.state.move(
                polled, Status.RESPONSE_RECEIVED_FROM_RECEIVER, now, response=outcome.body
            )
        except InvalidTransition:
            return Step.SKIPPED
        await ctx.respond(done)
        return Step.RESPONDED
    if outcome.verdict in (Verdict.ACCEPTED, Verdict.RETRY):
        due = now + max(next_poll_in(state.tries("poll") + 1), outcome.retry_after_s or 0.0)
        if due - delivered_at(state) > receiver.ttl_s:
            waited = now - delivered_at(state)
            return await ctx.fail(state, f"no result from the receiver within {waited:.0f} s (ttl)")
        await ctx.state.schedule(POLL, source_id, message_id, due)
        return Step.PENDING
    return await ctx.fail(state, f"polling the receiver's status: {outcome.reason}")
