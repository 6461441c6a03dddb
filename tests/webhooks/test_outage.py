"""A receiver down for 120 s, then back: every message sent before and during the outage is
delivered afterwards, once, by the retry schedule (no attempt sooner than the schedule allows),
with the workers idle in between (the retries wait in the state, not in a sleeping worker)."""

from __future__ import annotations

import base64
import itertools
import time
from pathlib import Path

import pytest

from headwater.collector.auth import hash_key
from headwater.config.model import HeadwaterConfig
from headwater.testing.waiting import wait_until
from headwater.testing.webhooks import (
    Received,
    Reply,
    post_json,
    running_headwater,
    running_receiver,
)
from headwater.webhooks.delivery import JITTER
from headwater.webhooks.state import Status, open_state

SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()
KEY = "outage-key"
OUTAGE_S = 120.0
SCHEDULE = [5.0, 30.0, 30.0, 30.0, 30.0, 30.0, 30.0]


@pytest.mark.outage
def test_a_receiver_down_for_two_minutes_gets_everything_afterwards(tmp_path: Path) -> None:
    down_until = [float("inf")]

    def script(n: int, r: Received) -> Reply:
        return Reply(503) if r.at < down_until[0] else Reply(200, b'{"ok":1}')

    with running_receiver(SECRET, script) as receiver:
        config = HeadwaterConfig.model_validate(
            {
                "data_dir": str(tmp_path / "data"),
                "webhooks": {
                    "receivers": [
                        {
                            "name": "down",
                            "url": receiver.url,
                            "secret": SECRET,
                            "retry_schedule_s": SCHEDULE,
                        }
                    ],
                    "sources": [{"id": "app", "write_keys": [hash_key(KEY)]}],
                },
            }
        )
        ids = [f"o{i}" for i in range(30)]
        with running_headwater(config) as hw:
            started = time.time()
            down_until[0] = started + OUTAGE_S
            for i, m in enumerate(ids):
                doc = {"message_id": m, "receiver": "down", "payload": {"i": i}}
                status, _ = post_json(
                    f"{hw.url}/webhooks/app", doc, {"authorization": f"Bearer {KEY}"}
                )
                assert status == 202
                if i == 14:  # half now, half well into the outage
                    wait_until(lambda: time.time() > started + 60, "a minute of outage", 90)
            with open_state(config) as store:
                wait_until(
                    lambda: all(store.get("app", m).status is Status.DONE for m in ids),  # type: ignore[union-attr]
                    "everything DONE after the outage",
                    OUTAGE_S + 120,
                )
                states = [store.get("app", m) for m in ids]
    ok = [r for r in receiver.requests if r.at >= down_until[0]]
    assert sorted(r.message_id for r in ok) == sorted(ids)  # each once, after the outage
    for state in states:
        assert state is not None
        attempts = [a.at for a in state.attempts if a.kind == "deliver"]
        assert len(attempts) >= 3  # it did wait through the outage
        for k, (before, after) in enumerate(itertools.pairwise(attempts)):
            assert after - before >= SCHEDULE[k] * (1 - JITTER) - 0.05, state.attempts
