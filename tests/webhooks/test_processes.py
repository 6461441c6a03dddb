"""The webhook transport over several processes, on real Apache Kafka and Redis (or the SQLite
state shared on one machine), against real local receivers:

- dedup: every message sent to two collector processes at once reaches the receiver once;
- crash: the webhook worker processes SIGKILLed at random moments (12 times) while messages
  flow: every accepted message ends DONE or FAILED with a reason, none is lost, and none is
  delivered twice to the receiver (it has a ``status_url``);
- rate limit: 3 worker processes, a receiver limited to 50/s, 2,000 messages (some first
  attempts refused, so retries run in every process): the receiver's own count over every
  10 s window stays within 52.5/s, and all 2,000 arrive.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.testing.collector import COLLECTOR_ROLE, CollectorProcess
from headwater.testing.kafka import KafkaCluster
from headwater.testing.redis import RedisService
from headwater.testing.waiting import wait_until
from headwater.testing.webhooks import (
    Received,
    Reply,
    post_json,
    running_receiver,
)
from headwater.webhooks.state import StateStore, Status, open_state

SECRET = "whsec_" + base64.b64encode(b"p" * 32).decode()
KEY = "sender-key"
AUTH = {"authorization": f"Bearer {KEY}"}
WORKER_ROLE = ("webhooks", "--port", "0")


def write_config(
    tmp_path: Path,
    kafka: KafkaCluster,
    state: dict[str, Any],
    receiver: dict[str, Any],
    callback_url: str | None = None,
) -> Path:
    prefix = f"wh{uuid.uuid4().hex[:8]}."
    source: dict[str, Any] = {"id": "app", "write_keys": [hash_key(KEY)]}
    if callback_url is not None:
        source |= {"callback_url": callback_url, "secret": SECRET}
    doc = {
        "data_dir": str(tmp_path / "data"),
        "bus": {
            "backend": "kafka",
            "kafka": {
                "bootstrap_servers": kafka.bootstrap_servers,
                "default_partitions": 2,
                # a SIGKILLed member leaves its group after 6 s (the broker's minimum)
                "consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000},
            },
        },
        "webhooks": {
            "topic_prefix": prefix,
            "state": state,
            "claim_lease_s": 5,
            "receivers": [{"name": "rx", "secret": SECRET, "timeout_s": 2, **receiver}],
            "sources": [source],
        },
    }
    path = tmp_path / "headwater.yaml"
    path.write_text(json.dumps(doc))
    return path


def redis_state(redis: RedisService) -> dict[str, Any]:
    return {
        "backend": "redis",
        "redis_url": redis.url,
        "redis_prefix": f"test:{uuid.uuid4().hex[:8]}:",
    }


@contextmanager
def processes(
    config_file: Path, tmp_path: Path, role: tuple[str, ...], n: int
) -> Iterator[list[CollectorProcess]]:
    started: list[CollectorProcess] = []
    try:
        for i in range(n):
            stderr = tmp_path / f"{role[0]}-{i}-{uuid.uuid4().hex[:4]}.log"
            started.append(CollectorProcess(config_file, stderr, role))
        for p in started:
            p.wait_healthy()
        yield started
    finally:
        for p in started:
            p.close()


def collector_url(p: CollectorProcess) -> str:
    line = next(x for x in p.out.seen if x.startswith("headwater: health at "))
    return line.split(" at ", 1)[1].removesuffix("/healthz")


def send(url: str, message_id: str) -> int:
    doc = {"message_id": message_id, "receiver": "rx", "payload": {"id": message_id}}
    status, answer = post_json(f"{url}/webhooks/app", doc, AUTH)
    assert status in (200, 202), answer
    return status


def settled(store: StateStore, ids: list[str]) -> dict[str, Any]:
    """The messages not yet DONE or FAILED (empty: all settled)."""
    out = {}
    for m in ids:
        state = store.get("app", m)
        if state is None or state.status not in (Status.DONE, Status.FAILED):
            out[m] = state.status if state else None
    return out


def posts_per_id(received: list[Received]) -> Counter[str]:
    return Counter(r.message_id for r in received if r.method == "POST")


def test_messages_sent_to_two_collectors_at_once_arrive_once(
    tmp_path: Path, kafka_broker: KafkaCluster, redis_service: RedisService
) -> None:
    with running_receiver(SECRET) as receiver:
        config_file = write_config(
            tmp_path, kafka_broker, redis_state(redis_service), {"url": receiver.url}
        )
        ids = [f"d{i}" for i in range(150)]
        with (
            processes(config_file, tmp_path, COLLECTOR_ROLE, 2) as collectors,
            processes(config_file, tmp_path, WORKER_ROLE, 1) as (worker,),
        ):
            urls = [collector_url(c) for c in collectors]

            def sender(url: str) -> None:
                for m in ids:
                    send(url, m)

            threads = [threading.Thread(target=sender, args=(u,)) for u in urls]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for m in ids[:10]:  # a third time, after the fact
                assert send(urls[0], m) in (200, 202)
            with open_state(load_config(config_file)) as store:
                wait_until(lambda: not settled(store, ids), "every message settled", 90)
                assert all(store.get("app", m).status is Status.DONE for m in ids)  # type: ignore[union-attr]
            assert worker.stop() == 0  # SIGTERM: a graceful stop
            assert "headwater: stopped" in worker.out.wait_for("headwater: stopped", 30)
        assert posts_per_id(receiver.requests) == Counter({m: 1 for m in ids})


@pytest.mark.parametrize("backend", ["redis", "embedded"])
def test_webhook_workers_killed_at_random_lose_and_repeat_nothing(
    backend: str, tmp_path: Path, kafka_broker: KafkaCluster, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(7)

    def script(n: int, r: Received) -> Reply:  # slow answers: kills land mid-request too
        return Reply(200, json.dumps({"ok": r.message_id}).encode(), delay_s=rng.random() * 0.3)

    state = (
        redis_state(request.getfixturevalue("redis_service"))
        if backend == "redis"
        else {"backend": "embedded"}
    )
    with (
        running_receiver(SECRET, script) as receiver,
        running_receiver(SECRET) as sender_endpoint,
        ExitStack() as stack,
    ):
        config_file = write_config(
            tmp_path,
            kafka_broker,
            state,
            {"url": receiver.url, "status_url": receiver.status_url, "retry_schedule_s": [1, 1]},
            callback_url=sender_endpoint.url,
        )
        (collector,) = stack.enter_context(processes(config_file, tmp_path, COLLECTOR_ROLE, 1))
        workers = stack.enter_context(processes(config_file, tmp_path, WORKER_ROLE, 2))
        url = collector_url(collector)
        accepted: list[str] = []
        done_sending = threading.Event()

        def load() -> None:
            i = 0
            while not done_sending.is_set():
                m = f"c{i}"
                send(url, m)
                accepted.append(m)
                i += 1
                done_sending.wait(0.02)  # about 50 messages a second

        loader = threading.Thread(target=load)
        loader.start()
        kills = 0
        try:
            for _ in range(12):
                done_sending.wait(rng.uniform(0.5, 2.0))  # a random moment
                k = rng.randrange(len(workers))
                workers[k].kill()
                workers[k].close()
                kills += 1
                stderr = tmp_path / f"webhooks-restart-{kills}.log"
                workers[k] = CollectorProcess(config_file, stderr, WORKER_ROLE)
                workers[k].wait_healthy()
        finally:
            done_sending.set()
            loader.join(60)
            stack.callback(lambda: [w.close() for w in workers])
        assert kills >= 10 and len(accepted) > 200
        with open_state(load_config(config_file)) as store:
            try:
                wait_until(lambda: not settled(store, accepted), "every message settled", 180)
            except AssertionError:
                stuck = settled(store, accepted)
                raise AssertionError(
                    f"{len(stuck)} message(s) not settled: "
                    + "; ".join(
                        f"{m}: {(s := store.get('app', m)) and s.to_json()}"
                        for m in list(stuck)[:3]
                    )
                ) from None
            states = [store.get("app", m) for m in accepted]
        failed = [s for s in states if s is not None and s.status is Status.FAILED]
        assert all(s.reason for s in failed)
        assert not failed, [(s.message_id, s.reason) for s in failed][:5]
    posts = posts_per_id(receiver.requests)
    assert set(posts) == set(accepted)  # none lost
    twice = {m: n for m, n in posts.items() if n > 1}
    assert not twice, twice  # none delivered twice
    assert set(posts_per_id(sender_endpoint.requests)) == set(accepted)  # all called back


def test_a_rate_limit_holds_across_three_worker_processes(
    tmp_path: Path, kafka_broker: KafkaCluster, redis_service: RedisService
) -> None:
    refused: set[str] = set()
    lock = threading.Lock()

    def script(n: int, r: Received) -> Reply:
        # every 7th message's first attempt is refused: its retry runs from the schedule,
        # in whichever of the three processes claims it
        with lock:
            if int(r.message_id[1:]) % 7 == 0 and r.message_id not in refused:
                refused.add(r.message_id)
                return Reply(503)
        return Reply(200, b'{"ok":1}')

    with running_receiver(SECRET, script) as receiver:
        config_file = write_config(
            tmp_path,
            kafka_broker,
            redis_state(redis_service),
            {
                "url": receiver.url,
                "rate_limit": {"requests": 50, "per_s": 1},
                "retry_schedule_s": [1, 1, 1],
            },
        )
        ids = [f"r{i}" for i in range(2000)]
        with (
            processes(config_file, tmp_path, COLLECTOR_ROLE, 1) as (collector,),
            processes(config_file, tmp_path, WORKER_ROLE, 3),
        ):
            url = collector_url(collector)
            for m in ids:
                send(url, m)
            with open_state(load_config(config_file)) as store:
                wait_until(lambda: not settled(store, ids), "all 2,000 settled", 150)
    posts = sorted(r.at for r in receiver.requests if r.method == "POST")
    assert {r.message_id for r in receiver.requests if r.method == "POST"} == set(ids)
    assert len(posts) == len(ids) + len(refused)
    # the receiver's count over every 10 s window (starting at each request)
    worst, j = 0, 0
    for i, start in enumerate(posts):
        while j < len(posts) and posts[j] < start + 10.0:
            j += 1
        worst = max(worst, j - i)
    assert worst <= 525, f"{worst} requests in 10 s"
    assert worst >= 450  # and the limit was what held it back
