"""The ``http`` destination under faults, with ``headwater pipeline`` as its own process (stream
mode, Spark ``local[2]``, the embedded log) and a real receiver in this process:

- 200 sessions and 100,000 events: each session's events arrive in log order, never two requests
  of one session at once, every event once;
- SIGKILLed at random moments 10 times while it delivers: every event arrives, and every request
  that repeats an event repeats an earlier request's idempotency key (a replayed micro-batch
  sends the same batches);
- the receiver answers 503 for 120 s while events keep arriving: the process tree's memory
  stays flat (the events wait on the log), and afterwards every event arrives once.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import yaml

from headwater.bus import context, open_bus
from headwater.bus.records import Message
from headwater.config.model import HeadwaterConfig
from headwater.testing.http_receiver import Batch, BatchReceiver, running_batch_receiver
from headwater.testing.pipeline_process import start_pipeline as start_process
from headwater.testing.pipeline_process import stop
from headwater.testing.proc_tree import tree_rss
from headwater.testing.webhooks import Reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TOPIC = "events-track"


def write_config(tmp_path: Path, receiver: BatchReceiver, **options: Any) -> HeadwaterConfig:
    document = {
        "data_dir": str(tmp_path / "data"),
        "bus": {"embedded": {"default_partitions": 2}},
        "pipeline": {
            "spark": {"master": "local[2]"},
            "destinations": [
                {
                    "id": "api",
                    "type": "http",
                    "mode": "stream",
                    "trigger_interval_s": 0.5,
                    "max_records_per_trigger": options.pop("per_trigger", 2_000),
                    "options": {
                        "url": receiver.url,
                        "group_by": ["/user"],
                        "timeout_s": 10,
                        "retry": {"initial_s": 0.2, "max_interval_s": 2.0, "max_elapsed_s": 600},
                        **options,
                    },
                }
            ],
        },
    }
    (tmp_path / "headwater.yaml").write_text(yaml.safe_dump(document))
    return HeadwaterConfig.model_validate(document)


def append(config: HeadwaterConfig, start: int, count: int, users: int) -> None:
    with closing(open_bus(config)) as bus:
        bus.create_topic(TOPIC, 2)
        messages = [
            Message(
                json.dumps({"n": i, "user": f"u{i % users}", "pad": "x" * 40}).encode(),
                key=f"u{i % users}".encode(),
                headers=(
                    (context.TYPE, b"track"),
                    (context.CONTENT_TYPE, b"application/json"),
                    (context.EVENT_ID, f"ev-{i:06d}".encode()),
                ),
            )
            for i in range(start, start + count)
        ]
        bus.append(TOPIC, messages).result(timeout=60)


def start_pipeline(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    return start_process(tmp_path / "headwater.yaml", tmp_path / "pipeline.log", *args)


def delivered_numbers(receiver: BatchReceiver) -> list[int]:
    return [e["n"] for b in receiver.delivered() for e in b.events]


def wait_for(what: str, condition: Any, timeout_s: float, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"the pipeline exited ({child.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)


def repeats_share_keys(requests: list[Batch]) -> list[str]:
    """The delivered requests that repeat an event without repeating an earlier key."""
    seen_events: set[int] = set()
    seen_keys: set[str] = set()
    bad = []
    for b in sorted(requests, key=lambda b: b.started):
        numbers = {e["n"] for e in b.events}
        if numbers & seen_events and b.key not in seen_keys:
            bad.append(b.key)
        seen_keys.add(b.key)
        if 200 <= b.status < 300:
            seen_events |= numbers
    return bad


def test_200_sessions_keep_order_and_one_request_in_flight(tmp_path: Path) -> None:
    with running_batch_receiver(lambda n, b: Reply(200, delay_s=0.005)) as receiver:
        config = write_config(tmp_path, receiver, max_batch_bytes=8_000, per_trigger=25_000)
        append(config, 0, 100_000, users=200)
        child = start_pipeline(tmp_path)
        try:
            wait_for("every event", lambda: len(delivered_numbers(receiver)) >= 100_000, 300, child)
        finally:
            stop(child, signal.SIGTERM)
        assert receiver.overlaps == []
        assert sorted(delivered_numbers(receiver)) == list(range(100_000))
        per_session: dict[str, list[int]] = {}
        for b in sorted(receiver.delivered(), key=lambda b: b.started):
            per_session.setdefault(b.session, []).extend(e["n"] for e in b.events)
        assert len(per_session) == 200
        for numbers in per_session.values():
            assert len({n % 200 for n in numbers}) == 1  # one user per session
            assert numbers == sorted(numbers)  # in log order


def test_sigkilled_while_delivering_every_event_arrives_and_repeats_share_keys(
    tmp_path: Path,
) -> None:
    rng = random.Random(11)
    with running_batch_receiver(lambda n, b: Reply(200, delay_s=0.02)) as receiver:
        config = write_config(tmp_path, receiver, max_batch_bytes=2_000, per_trigger=600)
        total = 3_000
        append(config, 0, total, users=7)
        for _ in range(10):
            child = start_pipeline(tmp_path)
            # killed while the k-th request of this run is in flight: its batch is not committed
            enough = len(receiver.requests) + rng.randint(1, 40)
            try:
                wait_for("requests", lambda e=enough: len(receiver.requests) >= e, 180, child)
            finally:
                stop(child)
            append(config, total, 1_000, users=7)
            total += 1_000
        child = start_pipeline(tmp_path)
        try:
            wait_for(
                "every event",
                lambda: set(delivered_numbers(receiver)) >= set(range(total)),
                300,
                child,
            )
        finally:
            stop(child, signal.SIGTERM)
    assert receiver.overlaps == []
    assert set(delivered_numbers(receiver)) == set(range(total))
    assert repeats_share_keys(receiver.requests) == []
    keys = [b.key for b in receiver.delivered()]
    assert len(keys) > len(set(keys)), "no kill landed in a delivery: nothing was replayed"


@pytest.mark.outage
def test_a_receiver_down_for_120_s_costs_no_memory_and_no_event(tmp_path: Path) -> None:
    outage = {"until": 0.0}

    def script(n: int, b: Batch) -> Reply:
        if time.monotonic() < outage["until"]:
            return Reply(503, b"down", headers={"Retry-After": "1"})
        return Reply(200)

    with running_batch_receiver(script) as receiver:
        config = write_config(tmp_path, receiver, max_batch_bytes=20_000)
        append(config, 0, 2_000, users=50)
        child = start_pipeline(tmp_path)
        try:
            wait_for(
                "the first events", lambda: len(delivered_numbers(receiver)) >= 2_000, 180, child
            )
            outage["until"] = time.monotonic() + 120
            outage_ends = time.time() + 119.9  # the receiver notes when a request started
            total, samples = 2_000, []
            while time.monotonic() < outage["until"]:  # events keep arriving: 500 a second
                append(config, total, 250, users=50)
                total += 250
                samples.append(tree_rss(child.pid))
                time.sleep(0.5)  # the load's pace, not synchronisation
            during = [b for b in receiver.delivered() if b.started < outage_ends]
            assert sum(len(b.events) for b in during) == 2_000  # nothing got through the outage
            wait_for("every event", lambda: len(delivered_numbers(receiver)) >= total, 300, child)
        finally:
            stop(child, signal.SIGTERM)
    settled = samples[len(samples) // 6 :]  # from 20 s into the outage
    growth = max(settled) - settled[0]
    assert growth < 100 << 20, f"the process tree grew by {growth >> 20} MB during the outage"
    assert sorted(delivered_numbers(receiver)) == list(range(total))
    assert any(b.status == 503 for b in receiver.requests)
