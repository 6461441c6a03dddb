"""The failed store and ``headwater failed list|show|replay``, on the embedded log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from headwater.cli.main import cli
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.failed import (
    REPLAY_OF,
    FailedEvent,
    FailedStore,
    failed_config,
    make_id,
    replay_topic,
)


def event(offset: int, destination: str = "warehouse", value: bytes = b"{bad") -> FailedEvent:
    return FailedEvent(
        id=make_id(destination, "events-track", 0, offset),
        destination=destination,
        step="decode",
        code="HW-PIPE-101",
        reason="the value is not valid JSON",
        topic="events-track",
        partition=0,
        offset=offset,
        failed_at=f"2024-05-0{offset + 1}T00:00:00.000Z",
        key=b"user-1" if offset == 0 else None,
        value=value,
        headers=(("type", b"track"), ("event-id", f"ev-{offset}".encode())),
    )


@pytest.fixture
def config(tmp_path: Path) -> HeadwaterConfig:
    return HeadwaterConfig.model_validate(
        {
            "data_dir": tmp_path / "data",
            "pipeline": {"destinations": [{"id": "warehouse", "type": "duckdb"}]},
        }
    )


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        "data_dir: data\npipeline:\n  destinations:\n    - {id: warehouse, type: duckdb}\n"
    )
    return path


def test_failed_events_round_trip_with_their_bytes_and_headers(config):
    store = FailedStore(config)
    store.append([event(0, value=b"\xff\x00raw"), event(1)])
    got = store.events()
    assert got == [event(0, value=b"\xff\x00raw"), event(1)]
    assert failed_config(config).log_dir() == config.data_dir / "failed"


def test_the_same_failure_appended_twice_is_one_event(config):
    store = FailedStore(config)
    store.append([event(0), event(1)])
    store.append([event(1)])  # a batch failed again after a crash
    assert [e.id for e in store.events()] == [event(0).id, event(1).id]


def test_filters_by_destination_and_time(config):
    store = FailedStore(config)
    store.append([event(0), event(1), event(2, destination="pg")])
    assert [e.offset for e in store.events("warehouse")] == [0, 1]
    assert [e.offset for e in store.events(since="2024-05-02")] == [1, 2]


def test_replay_goes_to_the_destination_replay_topic_with_original_headers(config):
    store = FailedStore(config)
    store.append([event(0), event(1, destination="pg")])
    assert store.replay(store.events("warehouse")) == {"warehouse": 1}
    records = list(store.records(replay_topic("warehouse")))
    assert len(records) == 1
    assert records[0].value == b"{bad" and records[0].key == b"user-1"
    assert dict(records[0].headers) == {
        "type": b"track",
        "event-id": b"ev-0",
        REPLAY_OF: event(0).id.encode(),
    }


def test_an_empty_store_lists_nothing(config):
    assert FailedStore(config).events() == []


def cli_run(config_file: Path, *args: str, code: int = 0):
    result = CliRunner().invoke(cli, ["--config", str(config_file), *args])
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def test_cli_list_show_and_replay(config_file, tmp_path):
    config = HeadwaterConfig.model_validate(
        {
            "data_dir": tmp_path / "data",
            "pipeline": {"destinations": [{"id": "warehouse", "type": "duckdb"}]},
        }
    )
    FailedStore(config).append([event(0), event(1)])
    text = cli_run(config_file, "failed", "list").output
    assert "warehouse:events-track:0:0" in text and "HW-PIPE-101" in text
    lines = cli_run(config_file, "failed", "list", "--format", "json").output.splitlines()
    assert [json.loads(line)["offset"] for line in lines] == [0, 1]
    shown = json.loads(
        cli_run(config_file, "failed", "show", event(0).id, "--format", "json").output
    )
    assert shown["value"] == "{bad" and shown["key"] == "user-1"
    assert shown["headers"]["event-id"] == "ev-0"
    out = cli_run(config_file, "failed", "replay", "--id", event(1).id, "--format", "json")
    assert json.loads(out.output) == {"replayed": {"warehouse": 1}}
    assert [r.offset for r in FailedStore(config).records(replay_topic("warehouse"))] == [0]


def test_cli_names_what_is_wrong(config_file):
    out = cli_run(config_file, "failed", "show", "nope", code=1).output
    assert "no failed event with id 'nope'" in out
    out = cli_run(config_file, "failed", "replay", "--destination", "pg", code=1).output
    assert "no destination named 'pg'" in out
