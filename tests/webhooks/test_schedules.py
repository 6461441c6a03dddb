"""Retries and polls wait in the state's schedules and run when due: with the schedule loop
running, a message that meets a 503 and then a receiver that accepts and answers later ends
with its result called back to the sender, without any worker sleeping on it."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

from headwater.testing.webhooks import Reply, Script, run_steps, running_receiver
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.schedules import run_schedules
from headwater.webhooks.state import MessageState, Status
from headwater.webhooks.state.sqlite import SqliteState

SECRET = "whsec_" + base64.b64encode(b"q" * 32).decode()
DEADLINE_S = 20.0


def in_turn(*replies: Reply) -> Script:
    calls = iter(range(1 << 30))
    return lambda n, r: replies[min(next(calls), len(replies) - 1)]


def test_due_retries_polls_and_callbacks_run_by_themselves(tmp_path: Path) -> None:
    with (
        running_receiver(
            SECRET, in_turn(Reply(503), Reply(202)), in_turn(Reply(200, b'{"ok": 1}'))
        ) as receiver,
        running_receiver(SECRET, in_turn(Reply(502), Reply(200))) as sender,
    ):
        config = WebhooksConfig.model_validate(
            {
                "receivers": [
                    {
                        "name": "ci",
                        "url": receiver.url,
                        "status_url": receiver.status_url,
                        "secret": SECRET,
                        "retry_schedule_s": [0.2],
                    }
                ],
                "sources": [{"id": "github", "callback_url": sender.url, "secret": SECRET}],
            }
        )
        store = SqliteState(tmp_path / "state.sqlite")
        ids = [f"m{i}" for i in range(3)]
        for m in ids:
            store.arrive("github", m, "ci", b"{}", time.time())
        responded: list[MessageState] = []

        async def flow(ctx: Receiving) -> list[Status]:
            from headwater.webhooks.callbacks import to_sender

            async def respond(state: MessageState) -> None:  # as ToSender would, from to_sender
                responded.append(state)
                await to_sender(ctx, state.source_id, state.message_id)

            ctx.respond = respond
            stop = asyncio.Event()
            loop = asyncio.create_task(run_schedules(ctx, stop))
            first = await asyncio.gather(*(ctx.to_receiver("github", m) for m in ids))
            assert set(first) <= {Step.SCHEDULED, Step.PENDING}
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                statuses = [store.get("github", m).status for m in ids]  # type: ignore[union-attr]
                if all(s in (Status.DONE, Status.FAILED) for s in statuses):
                    break
                await asyncio.sleep(0.05)  # polling the state for a condition, with a deadline
            stop.set()
            await loop
            return statuses

        statuses = run_steps(store, config, responded, flow)
        assert statuses == [Status.DONE] * 3
        assert len(receiver.posts()) >= 3 and all(p.verified for p in receiver.requests)
        assert {p.message_id for p in sender.posts() if p.message_id} == set(ids)
