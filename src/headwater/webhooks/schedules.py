"""The loop that runs what the state's schedules hold when it is due: retries of deliveries,
polls of pending results, retries of callbacks. Every worker process may run it; the state hands
each due entry to one claimant for ``claim_lease_s`` (``take_due`` with a lease), and the
claimant releases it when its step is over (unless the step scheduled it again). An entry whose
claimant died comes due again when the lease ends; a step only acts on a message in the status
it works on, and sends are claimed once more in the state (``begin_send``), so running it again
does no harm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from headwater.webhooks.callbacks import to_sender
from headwater.webhooks.polling import poll
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.state.base import CALLBACK, DELIVER, POLL

log = logging.getLogger(__name__)
IDLE_S = 0.05  # between looks at the schedules when nothing was due
BATCH = 64  # entries claimed per schedule per look
PURGE_EVERY_S = 60.0
PURGE_BATCH = 1000

StepFn = Callable[[Receiving, str, str], Awaitable[Step]]


async def _deliver(ctx: Receiving, source_id: str, message_id: str) -> Step:
    return await ctx.to_receiver(source_id, message_id)


STEPS: dict[str, StepFn] = {DELIVER: _deliver, POLL: poll, CALLBACK: to_sender}


async def run_due(ctx: Receiving) -> int:
    """Run every step due now (each schedule's earliest ``BATCH``); how many ran."""
    ran = 0
    lease = ctx.config.claim_lease_s
    for kind, step in STEPS.items():
        now = ctx.clock()
        due = await ctx.state.take_due(kind, now, BATCH, lease)
        results = await asyncio.gather(*(step(ctx, s, m) for s, m in due), return_exceptions=True)
        releases = []
        for (source_id, message_id), result in zip(due, results, strict=True):
            if isinstance(result, BaseException):
                log.error("webhooks: %s of %s/%s failed: %r", kind, source_id, message_id, result)
            else:
                releases.append(ctx.state.release(kind, source_id, message_id, now + lease))
        await asyncio.gather(*releases)
        ran += len(due)
    return ran


def purge(ctx: Receiving) -> int:
    """Forget the DONE messages older than ``retention_s``; how many."""
    before = ctx.clock() - ctx.config.retention_s
    total = 0
    while (n := ctx.store.purge(before, PURGE_BATCH)) > 0:
        total += n
    return total


async def run_schedules(ctx: Receiving, stop: asyncio.Event) -> None:
    """Run due steps until ``stop`` is set; every ``PURGE_EVERY_S``, forget DONE messages
    past their retention."""
    purged_at = 0.0
    while not stop.is_set():
        if time.monotonic() - purged_at > PURGE_EVERY_S:
            purged_at = time.monotonic()
            if n := await asyncio.to_thread(purge, ctx):
                log.info("webhooks: forgot %d DONE message(s) past webhooks.retention_s", n)
        if await run_due(ctx) == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), IDLE_S)
