"""One delivery of a message to its receiver, and what its answer means (the delivery
rules below), independent of the workers that schedule it:

- 2xx with a body: the receiver's result (sync response), to be forwarded to the sender;
  202, or 2xx with no body: accepted, the result comes later (polled at ``status_url``).
- 408, 429, 5xx, a timeout or a lost connection: transient; retry by the receiver's schedule,
  no sooner than a ``Retry-After`` asks.
- 410: the receiver is gone: disable it, fail the message.
- any other answer (4xx, 3xx: redirects are not followed): terminal for the message.

The ambiguous failure of seed 004 (the request may have arrived, its answer did not): when the
receiver has a ``status_url``, :func:`ask_status` tells whether it knows the message before a
retry sends it again.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from enum import StrEnum

from headwater.http.client import HttpClient
from headwater.http.headers import retry_after
from headwater.webhooks.config import ReceiverConfig
from headwater.webhooks.signing import Signer
from headwater.webhooks.state.base import EXCERPT_BYTES, Attempt

TRANSIENT_STATUSES = frozenset({408, 429})
JITTER = 0.2  # a retry waits its scheduled time +-20% (as Svix): a crowd does not return at once


class Verdict(StrEnum):
    RESULT = "result"  # 2xx with a body: the sync response
    ACCEPTED = "accepted"  # 202 / 2xx without a body: the result comes later
    RETRY = "retry"  # transient: try again later
    GONE = "gone"  # 410: disable the receiver
    FAILED = "failed"  # terminal for this message


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    attempt: Attempt
    body: bytes = b""
    retry_after_s: float | None = None
    ambiguous: bool = False  # no answer: the request may or may not have arrived

    @property
    def reason(self) -> str:
        a = self.attempt
        if a.status_code is None:
            return a.error
        return f"the receiver answered {a.status_code}" + (f": {a.excerpt}" if a.excerpt else "")


def judge(status: int, body: bytes) -> Verdict:
    if 200 <= status < 300:
        return Verdict.ACCEPTED if status == 202 or not body.strip() else Verdict.RESULT
    if status == 410:
        return Verdict.GONE
    if status in TRANSIENT_STATUSES or status >= 500:
        return Verdict.RETRY
    return Verdict.FAILED


def next_attempt_at(
    receiver: ReceiverConfig,
    tries: int,
    now: float,
    asked_s: float | None = None,
    rng: random.Random | None = None,
) -> float | None:
    """When to try again after ``tries`` attempts (None: the schedule is spent)."""
    schedule = receiver.retry_schedule_s
    if tries > len(schedule):
        return None
    wait = schedule[tries - 1] * (1 + (rng or random).uniform(-JITTER, JITTER))
    return now + max(wait, asked_s or 0.0)


async def deliver(
    session: HttpClient,
    receiver: ReceiverConfig,
    signer: Signer,
    message_id: str,
    payload: bytes,
    kind: str = "deliver",
    url: str | None = None,
) -> Outcome:
    """POST ``payload`` (signed) to the receiver (or to ``url``: a sender's callback)."""
    headers = {"content-type": "application/json", **signer.headers(message_id, payload)}
    return await _exchange(
        session, "POST", url or receiver.url, receiver.timeout_s, kind, headers, payload
    )


async def ask_status(
    session: HttpClient, receiver: ReceiverConfig, signer: Signer, message_id: str
) -> Outcome:
    """GET the receiver's ``status_url`` for the message: RESULT (done, with the result),
    ACCEPTED (known, result pending), FAILED with status 404 (never seen: send it), RETRY
    (no answer yet)."""
    assert receiver.status_url is not None
    url = receiver.status_url.replace("{message_id}", message_id)
    headers = signer.headers(message_id, b"")
    return await _exchange(session, "GET", url, receiver.timeout_s, "poll", headers, None)


async def _exchange(
    session: HttpClient,
    method: str,
    url: str,
    timeout_s: float,
    kind: str,
    headers: dict[str, str],
    body: bytes | None,
) -> Outcome:
    started, clock = time.time(), time.perf_counter()

    def attempt(status: int | None, excerpt: str = "", error: str = "") -> Attempt:
        duration_ms = (time.perf_counter() - clock) * 1000
        return Attempt(started, kind, status, round(duration_ms, 3), excerpt, error)

    try:
        response = await session.request(method, url, headers=headers, body=body, timeout=timeout_s)
    except TimeoutError:
        error = f"no answer within {timeout_s:g} s"
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    else:
        content = response.body
        excerpt = content[:EXCERPT_BYTES].decode(errors="replace")
        verdict = judge(response.status, content)
        asked = retry_after(response.headers.get("retry-after"), time.time())
        return Outcome(verdict, attempt(response.status, excerpt), content, asked)
    return Outcome(Verdict.RETRY, attempt(None, error=error), ambiguous=True)
