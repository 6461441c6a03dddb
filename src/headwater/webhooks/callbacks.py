"""The ToSender step (seed 004's ToSenderWorker, for one message): the receiver's response goes
back to the sender's ``callback_url``, signed with the source's secret, as JSON::

    {"message_id": "...", "receiver": "ci", "status": "RESPONSE_RECEIVED_FROM_RECEIVER",
     "response": <the receiver's JSON, or {"text": "..."} when it was not JSON>}

A callback is claimed in the state first (``begin_send``; made in the step that got the
response, it is covered by that send's claim, and the response is recorded with its outcome:
``Receiving.finish``), so two workers never call back for the same message at once; after a
worker died mid-callback the callback is sent again (the sender sees the same ``webhook-id``).
2xx: DONE. 408/429/5xx, no answer: retried on the state's ``callback`` schedule (Svix's waits)
until it is spent, then FAILED; any other answer: FAILED. A source without a ``callback_url``
wants no response: the message is DONE at once.
"""

from __future__ import annotations

import json

import orjson

from headwater.webhooks.delivery import Verdict, deliver, next_attempt_at
from headwater.webhooks.receiving import SEND_GRACE_S, Receiving, Step, not_before
from headwater.webhooks.state.base import (
    CALLBACK,
    Attempt,
    Claim,
    InvalidTransition,
    MessageState,
    Status,
)


def callback_body(state: MessageState) -> bytes:
    """The callback's JSON: the receiver's response as it came when it is JSON (spliced in,
    not parsed and written again), else as ``{"text": ...}``; none: null."""
    raw = state.response or b""
    if not raw.strip():
        response = b"null"
    elif _is_json(raw):
        response = raw.strip()
    else:
        response = orjson.dumps({"text": raw.decode(errors="replace")})
    head = orjson.dumps(
        {"message_id": state.message_id, "receiver": state.receiver, "status": state.status.value}
    )
    return head[:-1] + b',"response":' + response + b"}"


def _is_json(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses but JSON allows (integers past 64 bits)
            json.loads(raw)
        except ValueError:
            return False
    return True


async def to_sender(
    ctx: Receiving,
    source_id: str,
    message_id: str,
    from_topic: bool = False,
    state: MessageState | None = None,
) -> Step:
    """The step for one message; ``state``: the message as the step that got the response left
    it (not read again: the claim fails, MOVED, when it changed since)."""
    if state is None:
        state = await ctx.state.get(source_id, message_id)
    if state is None or state.status is not Status.RESPONSE_RECEIVED_FROM_RECEIVER:
        return Step.SKIPPED
    source = ctx.config.source(source_id)
    if source is None or source.callback_url is None:
        return await _done(ctx, state)
    endpoint = ctx.callback_endpoint(source)
    now = ctx.clock()
    due = not_before(state, CALLBACK, endpoint.retry_schedule_s, now) if from_topic else None
    if due is not None:  # a repeated record before the retry is due
        await ctx.state.schedule(CALLBACK, source_id, message_id, due)
        return Step.SCHEDULED
    if ctx.unrecorded(state):  # in the step that got the response: its send's claim covers it
        claim = Claim.CLAIMED
    else:
        claim = await ctx.state.begin_send(state, now, now + endpoint.timeout_s + SEND_GRACE_S)
    if claim in (Claim.BUSY, Claim.MOVED):  # another worker is calling back, or just did
        return await ctx.recheck(state, CALLBACK, endpoint.timeout_s)
    outcome = await deliver(
        ctx.session,
        endpoint,
        ctx.signer(endpoint),
        message_id,
        callback_body(state),
        kind="callback",
    )
    if outcome.verdict in (Verdict.RESULT, Verdict.ACCEPTED):
        return await _done(ctx, state, outcome.attempt)
    await ctx.record_response(state)
    await ctx.state.record_attempt(source_id, message_id, outcome.attempt)
    if outcome.verdict is Verdict.RETRY:
        now = ctx.clock()
        tries = state.tries("callback") + 1
        at = next_attempt_at(endpoint, tries, now, outcome.retry_after_s)
        if at is not None:
            await ctx.state.schedule(CALLBACK, source_id, message_id, at)
            return Step.SCHEDULED
        return await ctx.fail(
            state, f"callback to the sender gave up after {tries} attempts: {outcome.reason}"
        )
    return await ctx.fail(state, f"the sender's callback refused the response: {outcome.reason}")


async def _done(ctx: Receiving, state: MessageState, attempt: Attempt | None = None) -> Step:
    try:
        await ctx.finish(state, attempt)
    except InvalidTransition:
        if attempt is not None:
            await ctx.state.record_attempt(*state.key, attempt)
        return Step.SKIPPED
    return Step.DONE
