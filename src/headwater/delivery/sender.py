"""Sending one batch of a session, until it is delivered or its events are given up on:

- 2xx: delivered.
- 413: the batch is split in two halves, each sent (recursively, down to one event; an event
  the receiver refuses alone goes to the failed store). Neither OpenTelemetry's exporter nor
  Vector's sink does this.
- 429, 408, 5xx, a timeout, a lost connection: transient; tried again after ``initial_s``,
  each wait ``multiplier`` times longer up to ``max_interval_s``, +-``jitter``, never sooner
  than ``Retry-After``, until ``max_elapsed_s`` has passed: then its events go to the failed
  store with the last answer. Nothing is dropped silently.
- 401 and 403: the destination is misconfigured (its credentials): ``DestinationRefused``
  stops it with a clear error.
- any other answer: terminal for the batch's events (failed store, with the status and the
  start of the response).

Every request carries ``Idempotency-Key`` (deterministic: destination, batch, session, sequence
and, after a 413, the half: ``.0``/``.1``), so that a micro-batch replayed after a crash sends
the same keys, and ``X-Headwater-Session``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from headwater.delivery.bodies import BodyFormat, Pack, split
from headwater.delivery.config import HttpDeliveryConfig
from headwater.delivery.metrics import Tally
from headwater.errors import TerminalError
from headwater.http.client import HttpClient
from headwater.http.compression import gzip_compress
from headwater.http.headers import retry_after

SESSION_HEADER = "X-Headwater-Session"
IDEMPOTENCY_HEADER = "Idempotency-Key"
EXCERPT_BYTES = 300


class DestinationRefused(TerminalError):
    """The receiver refused the destination's credentials (401/403): stop, and say so."""

    code = "HW-DLV-001"
    stops_destination = True


@dataclass
class Outcome:
    delivered: int = 0
    requests: int = 0
    retries: int = 0
    failed: list[tuple[list[Pack], str]] = field(default_factory=list)  # events, reason

    def add(self, other: Outcome) -> Outcome:
        self.delivered += other.delivered
        self.requests += other.requests
        self.retries += other.retries
        self.failed += other.failed
        return self


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: no answer (timeout, connection error)
    excerpt: str
    retry_after_s: float | None

    def describe(self) -> str:
        if self.status is None:
            return self.excerpt
        return f"the receiver answered {self.status}" + (
            f": {self.excerpt}" if self.excerpt else ""
        )


class Sender:
    """Sends batches for one destination over one HTTP session (a Spark task's)."""

    def __init__(
        self,
        config: HttpDeliveryConfig,
        http: HttpClient,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.http = http
        self.format = BodyFormat(config.format, config.session_info)
        self.headers = {
            "content-type": "application/x-ndjson"
            if config.format == "ndjson"
            else "application/json",
            **config.resolved_headers(),
        }
        if config.compression == "gzip":
            self.headers["content-encoding"] = "gzip"
        self.rng = rng or random.Random()
        self.tally = Tally()  # bytes and latency of every request (the metrics')

    async def send(self, session: str, key: str, packs: Sequence[Pack]) -> Outcome:
        """Deliver ``packs`` as one batch of ``session`` (split on 413), retrying as the
        config says; raises ``DestinationRefused`` on 401/403."""
        outcome = Outcome()
        count = sum(p.count for p in packs)
        body = self.format.encode(session, packs)
        if self.config.compression == "gzip":
            body = gzip_compress(body, self.config.compression_level)
        headers = {**self.headers, SESSION_HEADER: session, IDEMPOTENCY_HEADER: key}
        retry = self.config.retry
        started = time.monotonic()
        wait = retry.initial_s
        while True:
            sent = time.monotonic()
            answer = await self._request(body, headers)
            self.tally.observe(time.monotonic() - sent)
            self.tally.bytes += len(body)
            outcome.requests += 1
            status = answer.status
            if status is not None and 200 <= status < 300:
                outcome.delivered += count
                return outcome
            if status == 413 and count > 1:
                first, second = split(packs, count // 2)
                outcome.add(await self.send(session, f"{key}.0", first))
                return outcome.add(await self.send(session, f"{key}.1", second))
            if status in (401, 403):
                raise DestinationRefused(
                    f"{self.config.url} refused the destination's credentials: {answer.describe()}"
                )
            if status is None or status in (408, 429) or status >= 500:
                delay = wait * (1 + self.rng.uniform(-retry.jitter, retry.jitter))
                delay = max(delay, answer.retry_after_s or 0.0)
                if time.monotonic() - started + delay > retry.max_elapsed_s:
                    waited = time.monotonic() - started
                    reason = f"gave up after {waited:.0f} s: {answer.describe()}"
                    outcome.failed.append((list(packs), reason))
                    return outcome
                outcome.retries += 1
                await asyncio.sleep(delay)
                wait = min(wait * retry.multiplier, retry.max_interval_s)
                continue
            outcome.failed.append((list(packs), answer.describe()))
            return outcome

    async def _request(self, body: bytes, headers: dict[str, str]) -> Answer:
        try:
            response = await self.http.request(
                self.config.method,
                self.config.url,
                headers=headers,
                body=body,
                timeout=self.config.timeout_s,
            )
        except TimeoutError:
            return Answer(None, f"no answer within {self.config.timeout_s:g} s", None)
        except OSError as e:
            return Answer(None, f"{type(e).__name__}: {e}", None)
        excerpt = response.body[:EXCERPT_BYTES].decode(errors="replace")
        asked = retry_after(response.headers.get("retry-after"), time.time())
        return Answer(response.status, excerpt, asked)
