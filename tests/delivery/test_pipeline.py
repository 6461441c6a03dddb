"""The ``http`` destination through the pipeline (Spark ``local[2]``, the embedded log, a real
receiver): events after the steps reach the receiver as nested JSON, grouped into sessions by
``group_by`` with each session in one task, in log order and one request in flight; a batch is
recorded once delivered, so another run sends nothing; 413 splits, oversize events trimmed,
terminal 4xx and given-up batches to the failed store and replayed from it; 401 stops the
destination with HW-DLV-001."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from headwater.bus import Message, open_bus
from headwater.bus import context as ctx
from headwater.cli.main import cli
from headwater.config.loader import load_config
from headwater.delivery.bodies import TRIMMED
from headwater.delivery.metrics import METRICS
from headwater.pipeline.runner import Pipeline
from headwater.testing.http_receiver import Batch, BatchReceiver, running_batch_receiver
from headwater.testing.webhooks import Reply

TOPIC = "events-track"
FAST_RETRY = {"initial_s": 0.05, "max_interval_s": 0.2, "max_elapsed_s": 3.0}


def write_config(
    path: Path, receiver: BatchReceiver, bus: dict[str, Any] | None = None, **options: Any
) -> Path:
    """One ``http`` destination ``api``; on a Kafka ``bus`` it reads a topic of its own."""
    destination = {
        "id": "api",
        "type": "http",
        "table_name_template": "{{ $type }}",
        "mapping": {"fields": [{"action": "remove", "src": "/secret"}]},
        "options": {"url": receiver.url, "retry": FAST_RETRY, "timeout_s": 5, **options},
    }
    pipeline: dict[str, Any] = {"destinations": [destination]}
    if bus is not None:
        suffix = uuid.uuid5(uuid.NAMESPACE_URL, str(path.parent)).hex[:10]
        destination["topics"] = [f"{TOPIC}-{suffix}"]
        pipeline["failed_topic"] = f"failed-{suffix}"
    document = {
        "data_dir": str(path.parent / "data"),
        "bus": bus or {"embedded": {"durability": "never"}},
        "pipeline": pipeline,
    }
    path.write_text(yaml.safe_dump(document))
    return path


def append(config_path: Path, values: list[dict[str, Any]], first: int = 0) -> None:
    config = load_config(config_path)
    topic = (config.pipeline.destinations[0].topics or [TOPIC])[0]
    with open_bus(config) as bus:
        bus.create_topic(topic, 2)
        messages = [
            Message(
                json.dumps(v).encode(),
                key=str(v.get("user", i)).encode(),
                headers=(
                    (ctx.TYPE, b"track"),
                    (ctx.CONTENT_TYPE, b"application/json"),
                    (ctx.EVENT_ID, f"ev-{first + i}".encode()),
                    (ctx.RECEIVED_AT, b"2024-05-01T12:00:00.000Z"),
                ),
            )
            for i, v in enumerate(values)
        ]
        bus.append(topic, messages).result()
        bus.flush()


def run_pipeline(spark: Any, config_path: Path) -> Pipeline:
    pipeline = Pipeline(load_config(config_path), spark)
    try:
        pipeline.run_once()
    finally:
        pipeline.stop()
    return pipeline


def cli_json(config_path: Path, *args: str) -> list[dict[str, Any]]:
    result = CliRunner().invoke(cli, ["--config", str(config_path), *args, "--format", "json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line) for line in result.output.splitlines()]


def metric(name: str) -> float:
    """A delivery metric of the destination ``api`` in this process (0 before any)."""
    suffix = "" if name.endswith(("_count", "_sum")) or name == "sessions" else "_total"
    value = METRICS.registry.get_sample_value(
        f"headwater_delivery_{name}{suffix}", {"destination": "api"}
    )
    return value or 0.0


def delivered_numbers(receiver: BatchReceiver) -> list[int]:
    return [e["n"] for b in receiver.delivered() for e in b.events]


def per_session(batches: list[Batch]) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    for b in sorted(batches, key=lambda b: b.started):
        seen[b.session] += [e["n"] for e in b.events]
    return seen


def test_sessions_by_group_by_in_log_order_one_in_flight_and_once(
    spark: Any, tmp_path: Path
) -> None:
    with running_batch_receiver() as receiver:
        config_path = write_config(
            tmp_path / "headwater.yaml", receiver, group_by=["/user"], max_batch_bytes=4_000
        )
        values = [
            {"n": n, "user": f"u{n % 20}", "secret": "s", "page": {"url": f"/p/{n}"}}
            for n in range(3_000)
        ]
        append(config_path, values)
        before = {name: metric(name) for name in ("events", "requests", "request_seconds_count")}
        pipeline = run_pipeline(spark, config_path)
        assert pipeline.queries[0].writer.failed_events == 0

        delivered = receiver.delivered()
        # the tasks' tallies, added up by the driver once the batch was committed
        assert metric("events") - before["events"] == 3_000
        assert metric("requests") - before["requests"] == len(receiver.requests)
        assert metric("request_seconds_count") - before["request_seconds_count"] == len(
            receiver.requests
        )
        assert metric("sessions") == 20
        assert receiver.overlaps == []
        got = [e for b in delivered for e in b.events]
        assert sorted(e["n"] for e in got) == list(range(3_000))
        sample = next(e for e in got if e["n"] == 7)
        assert sample["page"] == {"url": "/p/7"} and sample["user"] == "u7"
        assert "secret" not in sample  # the mapping ran before delivery
        sessions = per_session(delivered)
        assert len(sessions) == 20
        for ns in sessions.values():  # one user per session, in the log's order
            assert len({n % 20 for n in ns}) == 1
            assert ns == sorted(ns)
        keys = [b.key for b in delivered]
        assert len(keys) == len(set(keys)) and all(k.startswith("api:0:") for k in keys)

        again = run_pipeline(spark, config_path)  # recorded: nothing is sent twice
        assert len(receiver.requests) == len(delivered)
        assert again.queries[0].writer.written == 0


def test_without_group_by_each_task_is_one_session(spark: Any, tmp_path: Path) -> None:
    with running_batch_receiver() as receiver:
        config_path = write_config(tmp_path / "headwater.yaml", receiver, format="dataset")
        append(config_path, [{"n": n} for n in range(500)])
        run_pipeline(spark, config_path)
        delivered = receiver.delivered()
        assert sorted(e["n"] for b in delivered for e in b.events) == list(range(500))
        assert receiver.overlaps == []
        assert 1 <= len({b.session for b in delivered}) <= 2  # the log's two partitions


def test_413_splits_oversize_is_trimmed_and_4xx_goes_to_the_failed_store_for_replay(
    spark: Any, tmp_path: Path
) -> None:
    refuse = {"on": True}

    def script(count: int, batch: Batch) -> Reply:
        if len(batch.events) > 5:
            return Reply(413, b"too many")
        if refuse["on"] and any(e.get("bad") for e in batch.events):
            return Reply(422, b"bad event")
        return Reply(200, b"{}")

    with running_batch_receiver(script) as receiver:
        config_path = write_config(
            tmp_path / "headwater.yaml", receiver, group_by=["/user"], max_batch_bytes=10_000
        )
        values: list[dict[str, Any]] = [{"n": n, "user": "a", "pad": "x" * 200} for n in range(40)]
        values.append({"n": 40, "user": "b", "long": "y" * 20_000})  # larger than any batch
        values.append({"n": 41, "user": "c", "bad": True})
        append(config_path, values)
        pipeline = run_pipeline(spark, config_path)

        delivered = receiver.delivered()
        got = {e["n"]: e for b in delivered for e in b.events}
        assert sorted(got) == list(range(41))
        assert any(b.status == 413 for b in receiver.requests)  # split until they fit
        assert all(len(b.events) <= 5 for b in delivered)
        assert got[40][TRIMMED] == ["/long"] and len(got[40]["long"]) < 20_000
        assert pipeline.queries[0].writer.failed_events == 0  # counted by the tasks' store
        failed = cli_json(config_path, "failed", "list", "--destination", "api")
        assert [(f["step"], f["code"]) for f in failed] == [("deliver", "HW-DLV-002")]
        assert "422" in failed[0]["reason"]

        refuse["on"] = False
        assert cli_json(config_path, "failed", "replay", "--destination", "api") == [
            {"replayed": {"api": 1}}
        ]
        run_pipeline(spark, config_path)
        assert [e["n"] for e in receiver.delivered()[-1].events] == [41]


def test_401_stops_the_destination(spark: Any, tmp_path: Path) -> None:
    with running_batch_receiver(lambda count, batch: Reply(401, b"who are you")) as receiver:
        config_path = write_config(tmp_path / "headwater.yaml", receiver)
        append(config_path, [{"n": n} for n in range(10)])
        with pytest.raises(Exception, match=r"HW-DLV-001|refused the destination.s credentials"):
            run_pipeline(spark, config_path)

        # streaming, the destination stops for good (not retried) and says why
        document = yaml.safe_load(config_path.read_text())
        document["pipeline"]["destinations"][0]["mode"] = "stream"
        config_path.write_text(yaml.safe_dump(document))
        pipeline = Pipeline(load_config(config_path), spark)
        pipeline.start()
        try:
            assert pipeline.queries[0].finished.wait(120), "the destination was not stopped"
            status = pipeline.status.get("api")
            asked = len(receiver.requests)
        finally:
            pipeline.stop()
        assert status.state == "stopped" and status.last_error_code == "HW-DLV-001"
        assert "refused the destination's credentials" in (status.last_error or "")
        assert asked == len(receiver.requests) >= 2  # once per run, nothing after it stopped


def test_events_with_fields_never_seen_are_sent_once_and_whole(spark: Any, tmp_path: Path) -> None:
    """A batch whose events hold what the destination has not learned yet is planned again
    (as for every destination); what the first plan already sent is not sent again, and the
    new events are sent with their new fields."""
    with running_batch_receiver() as receiver:
        config_path = write_config(tmp_path / "headwater.yaml", receiver, group_by=["/user"])
        values: list[dict[str, Any]] = [{"n": n, "user": f"u{n % 3}"} for n in range(6_000)]
        for v in values[4_000:]:
            v["extra"] = {"k": v["n"], "tags": ["a"]}
        append(config_path, values)
        run_pipeline(spark, config_path)
        got = [e for b in receiver.delivered() for e in b.events]
        assert sorted(e["n"] for e in got) == list(range(6_000))  # each once
        assert all(e["extra"] == {"k": e["n"], "tags": ["a"]} for e in got if e["n"] >= 4_000)
        assert receiver.overlaps == []


@pytest.mark.kafka
def test_from_kafka_sessions_are_repartitioned_by_key(
    spark: Any, tmp_path: Path, kafka_broker: Any
) -> None:
    """From Apache Kafka (records read by Spark's connector), Spark moves each session's
    records to one task: same order, one request in flight, each event once."""
    client = {"bootstrap_servers": kafka_broker.bootstrap_servers, "timeout_s": 15.0}
    bus = {"backend": "kafka", "kafka": {**client, "consumer": {"session.timeout.ms": 6000}}}
    with running_batch_receiver() as receiver:
        config_path = write_config(
            tmp_path / "headwater.yaml", receiver, bus, group_by=["/user"], max_batch_bytes=3_000
        )
        append(config_path, [{"n": n, "user": f"u{n % 9}"} for n in range(2_000)])
        run_pipeline(spark, config_path)
        assert receiver.overlaps == []
        assert sorted(delivered_numbers(receiver)) == list(range(2_000))
        sessions = per_session(receiver.delivered())
        assert len(sessions) == 9
        for ns in sessions.values():
            assert len({n % 9 for n in ns}) == 1
            assert ns == sorted(ns)
