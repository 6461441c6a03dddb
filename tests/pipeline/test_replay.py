"""Failed events replayed through the pipeline: events a destination could not route go to the
failed store; once the configuration is fixed, ``headwater failed replay`` sends them back
through the destination's own query (its replay topic), and they land once, with their
original bytes and headers (on the embedded log, and on Apache Kafka, where the failed store is a
topic of the same cluster and the query reads through Spark's Kafka connector). Also: the
jsonl.gz archive receives each event's JSON as it was after context enrichment."""

from __future__ import annotations

import gzip
import json
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml
from click.testing import CliRunner

from headwater.bus import Message, open_bus
from headwater.bus import context as ctx
from headwater.cli.main import cli
from headwater.config.loader import load_config
from headwater.destinations import open_destination
from headwater.pipeline.failed import FailedStore
from headwater.pipeline.runner import Pipeline
from headwater.testing.warehouse import delta_query

TOPIC = "events-track"
EMBEDDED: dict[str, Any] = {"embedded": {"durability": "never"}}


def write_config(
    path: Path, template: str, bus: dict[str, Any] | None = None, /, **dest: Any
) -> Path:
    """A config with one destination ``warehouse``; on a Kafka ``bus`` (shared by the tests)
    it reads a topic of its own and keeps a failed store of its own."""
    destination = {"id": "warehouse", "type": "duckdb", "table_name_template": template, **dest}
    pipeline: dict[str, Any] = {"destinations": [destination]}
    if bus is not None and bus.get("backend") == "kafka":
        suffix = uuid.uuid5(uuid.NAMESPACE_URL, str(path.parent)).hex[:10]
        destination["topics"] = [f"{TOPIC}-{suffix}"]
        pipeline["failed_topic"] = f"failed-{suffix}"
    document = {"data_dir": str(path.parent / "data"), "bus": bus or EMBEDDED, "pipeline": pipeline}
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_section(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "embedded":
        return EMBEDDED
    broker = request.getfixturevalue("kafka_broker")
    client = {"bootstrap_servers": broker.bootstrap_servers, "timeout_s": 15.0}
    return {"backend": "kafka", "kafka": {**client, "consumer": {"session.timeout.ms": 6000}}}


def append_events(config_path: Path, values: list[dict[str, Any]]) -> None:
    config = load_config(config_path)
    topic = (config.pipeline.destinations[0].topics or [TOPIC])[0]
    with open_bus(config) as bus:
        bus.create_topic(topic, 2)
        messages = [
            Message(
                json.dumps(v).encode(),
                key=str(i).encode(),
                headers=(
                    (ctx.TYPE, b"track"),
                    (ctx.CONTENT_TYPE, b"application/json"),
                    (ctx.EVENT_ID, f"ev-{v['n']}".encode()),
                    (ctx.RECEIVED_AT, b"2024-05-01T12:00:00.000Z"),
                    (ctx.CLIENT_IP, b"81.2.69.142"),
                    (ctx.PROTOCOL, b"raccoon-ws"),
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


def rows(config_path: Path, sql: str) -> list[tuple[Any, ...]]:
    config = load_config(config_path)
    dest = config.pipeline.destinations[0]
    if dest.type == "delta":  # read by delta-rs
        d = open_destination(dest, config.data_dir)
        try:
            return delta_query(d, sql)
        finally:
            d.close()
    path = config.warehouse_path()
    with duckdb.connect(str(path), read_only=True) as con:
        return con.execute(sql).fetchall()


def cli_json(config_path: Path, *args: str) -> list[dict[str, Any]]:
    result = CliRunner().invoke(cli, ["--config", str(config_path), *args, "--format", "json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line) for line in result.output.splitlines()]


@pytest.fixture(params=["duckdb", "delta", "delta-s3"])
def dest_type(request: pytest.FixtureRequest, bus_section: dict[str, Any]) -> dict[str, Any]:
    """The destination: DuckDB on either bus; on the embedded log, a Delta folder
    (<data_dir>/delta/warehouse) and Delta tables on the S3 server (the Spark tasks write their
    files there with the keys in the destination's storage_options)."""
    if request.param == "duckdb":
        return {}
    if bus_section is not EMBEDDED:
        pytest.skip("Delta is checked on the embedded log")
    if request.param == "delta":
        return {"type": "delta", "options": {"partition_by": None}}
    s3 = request.getfixturevalue("s3_server")
    bucket = s3.create_bucket(f"replay-{uuid.uuid4().hex[:12]}")
    options = {"storage_options": s3.storage_options}
    return {"type": "delta", "path": f"s3a://{bucket}/lake", "options": options}


def test_failed_events_replayed_after_a_fix_land_once(
    spark: Any, tmp_path: Path, bus_section: dict[str, Any], dest_type: dict[str, Any]
) -> None:
    config_path = write_config(
        tmp_path / "headwater.yaml", "{{ category }}", bus_section, **dest_type
    )
    values = [{"n": n, "category": "books"} if n % 3 else {"n": n} for n in range(12)]
    append_events(config_path, values)

    run_pipeline(spark, config_path)
    assert rows(config_path, "select count(*) from books") == [(8,)]
    failed = cli_json(config_path, "failed", "list", "--destination", "warehouse")
    assert len(failed) == 4 and {f["step"] for f in failed} == {"route"}
    assert all("category" in f["reason"] for f in failed)
    shown = [cli_json(config_path, "failed", "show", f["id"])[0] for f in failed]
    assert sorted(s["headers"]["event-id"] for s in shown) == ["ev-0", "ev-3", "ev-6", "ev-9"]
    assert all(json.loads(s["value"]) == {"n": int(s["headers"]["event-id"][3:])} for s in shown)

    # the operator fixes the template, then replays what failed
    write_config(config_path, "{{ category | default('misc') }}", bus_section, **dest_type)
    assert cli_json(config_path, "failed", "replay", "--destination", "warehouse") == [
        {"replayed": {"warehouse": 4}}
    ]
    pipeline = run_pipeline(spark, config_path)
    assert pipeline.queries[0].writer.written == 4
    got = rows(config_path, "select n, eventn_ctx_event_id, source_ip from misc order by n")
    assert got == [(n, f"ev-{n}", "81.2.69.142") for n in (0, 3, 6, 9)]
    assert rows(config_path, "select count(*) from books") == [(8,)]

    # nothing twice: another run finds nothing new, on the main topic or the replay topic
    again = run_pipeline(spark, config_path)
    assert again.queries[0].writer.written == 0
    assert rows(config_path, "select count(*) from misc") == [(4,)]
    assert len(FailedStore(load_config(config_path)).events()) == 4  # the store keeps history


def test_the_jsonl_archive_holds_each_event_after_context_enrichment(
    spark: Any, tmp_path: Path
) -> None:
    config_path = write_config(
        tmp_path / "headwater.yaml", "{{ $type }}", type="files", format="jsonl.gz"
    )
    values = [{"n": n, "user": {"id": f"u{n}"}, "tags": ["a", "b"]} for n in range(5)]
    append_events(config_path, values)
    run_pipeline(spark, config_path)
    root = tmp_path / "data" / "files" / "warehouse" / "track" / "2024-05-01"
    lines = [
        json.loads(line)
        for path in sorted(root.glob("*.jsonl.gz"))
        for line in gzip.decompress(path.read_bytes()).splitlines()
    ]
    assert sorted(e["n"] for e in lines) == list(range(5))
    first = next(e for e in lines if e["n"] == 0)
    assert first["user"] == {"id": "u0"} and first["tags"] == ["a", "b"]  # not flattened
    assert first["source_ip"] == "81.2.69.142" and first["src"] == "raccoon-ws"
    assert first["eventn_ctx"]["event_id"] == "ev-0"
    assert first["_timestamp"].startswith("2024-05-01")


def test_a_checkpoint_with_a_source_per_bus_keeps_its_layout(
    spark: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """A destination's query reads its topics and its replay topic with one source; a
    checkpoint made when each had a source of its own (two lines of offsets per batch) is
    resumed with that layout, replays included, and nothing lands twice."""
    from headwater.pipeline import runner

    config_path = write_config(tmp_path / "headwater.yaml", "{{ category | default('misc') }}")
    checkpoint = load_config(config_path).checkpoint_dir() / "warehouse"
    append_events(config_path, [{"n": n, "category": "books"} for n in range(4)])
    with monkeypatch.context() as m:  # as an earlier headwater made it: a source per bus
        m.setattr(runner, "sources_in", lambda _: 2)
        run_pipeline(spark, config_path)
    assert runner.sources_in(checkpoint) == 2
    append_events(config_path, [{"n": n, "category": "books"} for n in range(4, 6)])
    assert run_pipeline(spark, config_path).queries[0].writer.written == 2
    assert runner.sources_in(checkpoint) == 2
    assert rows(config_path, "select count(*), count(distinct n) from books") == [(6, 6)]

    (tmp_path / "fresh").mkdir()
    fresh = write_config(tmp_path / "fresh" / "headwater.yaml", "{{ category }}")
    append_events(fresh, [{"n": 1, "category": "books"}])
    run_pipeline(spark, fresh)
    assert runner.sources_in(load_config(fresh).checkpoint_dir() / "warehouse") == 1
