"""The webhook transport end to end in one process (the collector's intake, the embedded log,
the workers, the SQLite state) against real local HTTP receivers and a sender's callback
endpoint: sync and async results called back, duplicates delivered once, precise errors at
intake with nothing stored, a 410 that disables a receiver until it is enabled, strict FIFO
for an ordered receiver, and failed messages retried from the CLI."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from headwater.bus import open_bus
from headwater.cli.main import cli
from headwater.collector.auth import hash_key
from headwater.config.model import HeadwaterConfig
from headwater.testing.waiting import wait_until
from headwater.testing.webhooks import (
    Receiver,
    Reply,
    get_json,
    post_json,
    running_headwater,
    running_receiver,
)
from headwater.webhooks.routing import FROM_SENDER
from headwater.webhooks.state import Status, open_state

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
SENDER_SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
KEY = "github-key"
AUTH = {"authorization": f"Bearer {KEY}"}


def make_config(
    tmp_path: Path, receiver: Receiver, sender: Receiver | None = None, **receiver_extra: Any
) -> HeadwaterConfig:
    source: dict[str, Any] = {"id": "github", "write_keys": [hash_key(KEY)]}
    if sender is not None:
        source |= {"callback_url": sender.url, "secret": SENDER_SECRET}
    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "webhooks": {
                "receivers": [
                    {
                        "name": "ci",
                        "url": receiver.url,
                        "secret": SECRET,
                        "timeout_s": 5,
                        "retry_schedule_s": [0.2, 0.2, 0.2],
                        **receiver_extra,
                    }
                ],
                "sources": [source],
                "claim_lease_s": 10,
            },
        }
    )


def send(url: str, message_id: str, payload: object, receiver: str = "ci") -> tuple[int, Any]:
    doc = {"message_id": message_id, "receiver": receiver, "payload": payload}
    return post_json(f"{url}/webhooks/github", doc, AUTH)


def statuses(config: HeadwaterConfig, ids: list[str]) -> dict[str, Status | None]:
    with open_state(config) as store:
        found = {m: store.get("github", m) for m in ids}
    return {m: (s.status if s else None) for m, s in found.items()}


def all_are(config: HeadwaterConfig, ids: list[str], status: Status) -> bool:
    return all(s is status for s in statuses(config, ids).values())


def test_sync_results_reach_the_sender_once_each(tmp_path: Path) -> None:
    reply = Reply(200, b'{"build": "ok"}')
    with (
        running_receiver(SECRET, lambda n, r: reply) as receiver,
        running_receiver(SENDER_SECRET) as sender,
    ):
        config = make_config(tmp_path, receiver, sender)
        ids = [f"m{i}" for i in range(20)]
        with running_headwater(config) as hw:
            for i, m in enumerate(ids):
                status, answer = send(hw.url, m, {"n": i})
                assert status == 202, answer
                assert answer["status_url"] == f"{hw.url}/webhooks/github/messages/{m}"
            wait_until(lambda: all_are(config, ids, Status.DONE), "every message DONE")
            status, doc = get_json(f"{hw.url}/webhooks/github/messages/m3", AUTH)
        assert status == 200 and doc["status"] == "DONE"
        assert [t["status"] for t in doc["history"]] == [s.value for s in Status][:4]
        kinds = [(a["kind"], a["status_code"]) for a in doc["attempts"]]
        assert kinds == [("deliver", 200), ("callback", 200)]
        posts = receiver.posts()
        assert sorted(p.message_id for p in posts) == sorted(ids)  # each exactly once
        assert all(p.verified for p in posts)
        assert json.loads(receiver.posts("m3")[0].body) == {"n": 3}
        calls = sender.posts()
        assert sorted(c.message_id for c in calls) == sorted(ids) and all(c.verified for c in calls)
        callback = json.loads(sender.posts("m3")[0].body)
        assert callback == {
            "message_id": "m3",
            "receiver": "ci",
            "status": "RESPONSE_RECEIVED_FROM_RECEIVER",
            "response": {"build": "ok"},
        }


def test_a_message_sent_three_times_is_delivered_once(tmp_path: Path) -> None:
    with running_receiver(SECRET) as receiver:
        config = make_config(tmp_path, receiver)
        with running_headwater(config) as hw:
            first, answer = send(hw.url, "dup", {"a": 1})
            assert first == 202, answer
            wait_until(lambda: all_are(config, ["dup"], Status.DONE), "the first DONE")
            for _ in range(2):
                again, answer = send(hw.url, "dup", {"a": "changed"})
                assert again == 200 and answer["duplicate"] is True
                assert answer["status"] == "DONE"
            # and repeats that race the first one's recording are deduplicated by FromSender
            assert send(hw.url, "race", {"b": 1})[0] == 202
            assert send(hw.url, "race", {"b": 1})[0] in (200, 202)
            wait_until(lambda: all_are(config, ["race"], Status.DONE), "race DONE")
        assert [p.message_id for p in receiver.posts()].count("dup") == 1
        assert [p.message_id for p in receiver.posts()].count("race") == 1
        assert json.loads(receiver.posts("dup")[0].body) == {"a": 1}


def slow_and_fast(tmp_path: Path, delay_s: float, slow_count: int) -> list[Status | None]:
    """``slow_count`` messages to a receiver answering after ``delay_s``, then 16 to one
    answering at once (``concurrency`` 4): the slow ones' statuses when every fast one is DONE.
    Each message is delivered once, and every slow one is DONE in the end."""
    slow_reply = Reply(200, b'{"slow": 1}', delay_s=delay_s)
    with (
        running_receiver(SECRET, lambda n, r: slow_reply) as slow,
        running_receiver(SECRET, lambda n, r: Reply(200, b'{"fast": 1}')) as fast,
    ):
        receivers = [
            {"name": name, "url": r.url, "secret": SECRET, "timeout_s": 10}
            for name, r in (("slow", slow), ("ci", fast))
        ]
        config = HeadwaterConfig.model_validate(
            {
                "data_dir": str(tmp_path / "data"),
                "webhooks": {
                    "receivers": receivers,
                    "sources": [{"id": "github", "write_keys": [hash_key(KEY)]}],
                    "concurrency": 4,
                },
            }
        )
        slow_ids = [f"s{i}" for i in range(slow_count)]
        fast_ids = [f"f{i}" for i in range(16)]
        with running_headwater(config) as hw:
            for m in slow_ids:
                assert send(hw.url, m, {"m": m}, receiver="slow")[0] == 202
            for m in fast_ids:
                assert send(hw.url, m, {"m": m})[0] == 202
            wait_until(lambda: all_are(config, fast_ids, Status.DONE), "the fast ones DONE")
            seen = list(statuses(config, slow_ids).values())
            wait_until(lambda: all_are(config, slow_ids, Status.DONE), "the slow ones DONE", 60)
        assert sorted(p.message_id for p in slow.posts()) == sorted(slow_ids)  # once each
        assert sorted(p.message_id for p in fast.posts()) == sorted(fast_ids)
    return seen


def test_a_slow_receiver_holds_only_its_own_messages(tmp_path: Path) -> None:
    """FromSender runs a receiver's step in place, up to ``concurrency`` of them a receiver
    (the rest go through its topic); the steps it waits for do not hold its consumer, so
    another receiver's messages are delivered while a slow one's are still on their way."""
    # as many as a receiver's steps in place, 4 s each: the consumer went on meanwhile
    seen = slow_and_fast(tmp_path, 4.0, 4)
    assert all(s is not Status.DONE for s in seen)


def test_a_slow_receiver_that_keeps_answering_does_not_hold_the_others(tmp_path: Path) -> None:
    """A receiver whose steps take longer than ``SLOW_S`` is slow even while it ends them: its
    messages past the bound go through its topic rather than holding FromSender, so the other
    receivers' messages are not paced by its answers."""
    seen = slow_and_fast(tmp_path, 0.5, 48)  # 3-6 s of answers, 4 or 8 at a time
    assert sum(s is Status.DONE for s in seen) < 24, seen


def test_bad_input_is_refused_precisely_and_stores_nothing(tmp_path: Path) -> None:
    with running_receiver(SECRET) as receiver:
        config = make_config(tmp_path, receiver)
        small = config.webhooks.model_copy(update={"max_payload_bytes": 1000})
        config = config.model_copy(update={"webhooks": small})
        with running_headwater(config, with_webhooks=False) as hw:
            url = f"{hw.url}/webhooks/github"
            cases = [
                (
                    f"{hw.url}/webhooks/gitlab",
                    {"message_id": "m", "receiver": "ci", "payload": 1},
                    AUTH,
                    404,
                    "no webhook source 'gitlab'",
                ),
                (
                    url,
                    {"message_id": "m", "receiver": "ci", "payload": 1},
                    {"authorization": "Bearer wrong"},
                    401,
                    "unknown write key",
                ),
                (
                    url,
                    {"message_id": "m", "receiver": "ci", "payload": 1},
                    {},
                    401,
                    "a write key is required",
                ),
                (url, b"{not json", AUTH, 400, "not JSON"),
                (url, [1, 2], AUTH, 400, "must be a JSON object"),
                (url, {"receiver": "ci", "payload": 1}, AUTH, 400, "message_id is required"),
                (url, {"message_id": "m", "payload": 1}, AUTH, 400, "receiver is required"),
                (url, {"message_id": "m", "receiver": "ci"}, AUTH, 400, "payload is required"),
                (
                    url,
                    {"message_id": "m", "receiver": "nope", "payload": 1},
                    AUTH,
                    422,
                    "no receiver named 'nope' (webhooks.receivers: ci)",
                ),
                (
                    url,
                    {"message_id": "m", "receiver": "ci", "payload": "x" * 2000},
                    AUTH,
                    413,
                    "webhooks.max_payload_bytes",
                ),
            ]
            for target, body, headers, code, reason in cases:
                status, answer = post_json(target, body, headers)
                assert status == code, (body, answer)
                assert reason in str(answer["error"]), answer
            # the id may come in a webhook-id header instead
            ok, _ = post_json(url, {"receiver": "ci", "payload": {}}, {**AUTH, "webhook-id": "h1"})
            assert ok == 202
            status, answer = get_json(f"{url}/messages/never", AUTH)
            assert status == 404 and "never" in str(answer["error"])
            assert get_json(f"{url}/messages/h1", {})[0] == 401
        with open_bus(config, read_only=True) as bus:
            partitions = range(bus.topic(FROM_SENDER).partitions)
            assert sum(bus.watermarks(FROM_SENDER, p)[1] for p in partitions) == 1  # the good one


def test_an_async_result_is_polled_and_called_back(tmp_path: Path) -> None:
    # accepted without a result; the status endpoint answers 202 twice, then the result
    with (
        running_receiver(
            SECRET,
            lambda n, r: Reply(202),
            # n counts every request before this one, the POST included
            lambda n, r: Reply(202) if n < 3 else Reply(200, b'{"deployed": true}'),
        ) as receiver,
        running_receiver(SENDER_SECRET) as sender,
    ):
        config = make_config(tmp_path, receiver, sender, status_url=receiver.status_url)
        with running_headwater(config) as hw:
            assert send(hw.url, "slow", {"x": 1})[0] == 202
            wait_until(lambda: all_are(config, ["slow"], Status.DONE), "DONE", timeout=30)
        with open_state(config) as store:
            state = store.get("github", "slow")
        assert state is not None and state.response == b'{"deployed": true}'
        assert [a.kind for a in state.attempts] == ["deliver", "poll", "poll", "poll", "callback"]
        assert json.loads(sender.posts("slow")[0].body)["response"] == {"deployed": True}
        assert len(receiver.posts("slow")) == 1


def test_a_410_disables_the_receiver_until_it_is_enabled(tmp_path: Path) -> None:
    gone = [True]
    with running_receiver(
        SECRET, lambda n, r: Reply(410, b"gone") if gone[0] else Reply(200, b'{"ok":1}')
    ) as receiver:
        config = make_config(tmp_path, receiver)
        config_file = tmp_path / "headwater.yaml"
        config_file.write_text(json.dumps(config.model_dump(mode="json")))
        with running_headwater(config) as hw:
            assert send(hw.url, "first", {})[0] == 202
            wait_until(lambda: all_are(config, ["first"], Status.FAILED), "first FAILED")
            listed = CliRunner().invoke(
                cli, ["--config", str(config_file), "webhooks", "receivers", "list"]
            )
            assert listed.exit_code == 0 and "disabled" in listed.output, listed.output
            ids = [f"held{i}" for i in range(5)]
            for m in ids:
                assert send(hw.url, m, {})[0] == 202
            wait_until(lambda: all_are(config, ids, Status.ARRIVED), "recorded")
            held = len(receiver.posts())
            assert held == 1  # nothing sent to a disabled receiver
            gone[0] = False
            enabled = CliRunner().invoke(
                cli, ["--config", str(config_file), "webhooks", "receivers", "enable", "ci"]
            )
            assert enabled.exit_code == 0, enabled.output
            wait_until(lambda: all_are(config, ids, Status.DONE), "held ones DONE after enable")
        with open_state(config) as store:
            first = store.get("github", "first")
        assert first is not None and "gone" in first.reason


def test_an_ordered_receiver_gets_its_messages_in_order(tmp_path: Path) -> None:
    # the first message meets two 503s: the others wait behind it (strict FIFO)
    def script(n: int, r: Any) -> Reply:
        return Reply(503) if r.message_id == "o0" and n < 2 else Reply(200, b'{"ok":1}')

    with running_receiver(SECRET, script) as receiver:
        config = make_config(tmp_path, receiver, ordered=True)
        ids = [f"o{i}" for i in range(6)]
        with running_headwater(config) as hw:
            for m in ids:
                assert send(hw.url, m, {})[0] == 202
            wait_until(lambda: all_are(config, ids, Status.DONE), "every message DONE")
        assert [p.message_id for p in receiver.posts()] == ["o0", "o0", *ids]


def test_failed_messages_are_listed_shown_and_retried(tmp_path: Path) -> None:
    broken = [True]
    with running_receiver(
        SECRET, lambda n, r: Reply(400, b"bad") if broken[0] else Reply(200, b'{"ok":1}')
    ) as receiver:
        config = make_config(tmp_path, receiver)
        config_file = tmp_path / "headwater.yaml"
        config_file.write_text(json.dumps(config.model_dump(mode="json")))
        ids = ["f1", "f2"]

        def hw_cli(*args: str) -> str:
            result = CliRunner().invoke(cli, ["--config", str(config_file), "webhooks", *args])
            assert result.exit_code == 0, result.output
            return result.output

        with running_headwater(config) as hw:
            for m in ids:
                assert send(hw.url, m, {})[0] == 202
            wait_until(lambda: all_are(config, ids, Status.FAILED), "both FAILED")
            lines = [
                json.loads(x) for x in hw_cli("failed", "list", "--format", "json").splitlines()
            ]
            assert [(x["message_id"], x["receiver"]) for x in lines] == [("f1", "ci"), ("f2", "ci")]
            assert "the receiver answered 400: bad" in lines[0]["reason"]
            shown = json.loads(hw_cli("failed", "show", "github", "f1", "--format", "json"))
            assert shown["status"] == "FAILED" and shown["attempts"][0]["status_code"] == 400
            broken[0] = False
            assert "retried 1 message(s)" in hw_cli("failed", "retry", "github/f1")
            wait_until(lambda: all_are(config, ["f1"], Status.DONE), "f1 DONE after its retry")
            assert "retried 1 message(s)" in hw_cli("failed", "retry", "--receiver", "ci")
            wait_until(lambda: all_are(config, ids, Status.DONE), "both DONE")
        assert hw_cli("failed", "list", "--format", "json").strip() == ""
        refused = CliRunner().invoke(
            cli, ["--config", str(config_file), "webhooks", "failed", "retry", "github/f1"]
        )
        assert refused.exit_code != 0 and "is DONE, not FAILED" in refused.output


def test_the_webhooks_role_refuses_an_embedded_log_held_by_up(tmp_path: Path) -> None:
    with running_receiver(SECRET) as receiver:
        config = make_config(tmp_path, receiver)
        config_file = tmp_path / "headwater.yaml"
        config_file.write_text(json.dumps(config.model_dump(mode="json")))
        with running_headwater(config):
            result = CliRunner().invoke(
                cli, ["--config", str(config_file), "webhooks", "--port", "0"]
            )
        assert result.exit_code != 0
        assert "held by another process" in result.output
        assert "bus: kafka" in result.output
