"""Data contracts through Spark, with events sent by Segment's analytics-python to a running
collector: events that break an ``enforce`` contract are in the failed store with every
violation's path; once the schema is fixed, ``headwater failed replay`` lands them, once. Under
``warn`` they land, with their violations in ``_hw_violations``."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path
from typing import Any

import yaml
from segment.analytics import Client
from tests.pipeline.test_replay import cli_json, rows, run_pipeline

from headwater.bus import open_bus
from headwater.collector.auth import hash_key
from headwater.collector.config import CollectorConfig, SourceConfig
from headwater.config.loader import load_config
from headwater.testing.collector import running_collector

KEY = "contracts-write-key"


def schema(plans: list[str]) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["event", "properties"],
        "properties": {
            "properties": {
                "type": "object",
                "required": ["plan", "seats"],
                "properties": {
                    "plan": {"enum": plans},
                    "seats": {"type": "integer", "minimum": 1},
                },
            }
        },
    }


def write(tmp_path: Path, plans: list[str], mode: str = "enforce") -> Path:
    folder = tmp_path / "contracts" / "signed_up"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "1-0-0.json").write_text(json.dumps(schema(plans)))
    destination = {
        "id": "warehouse",
        "type": "duckdb",
        "table_name_template": "signups",
        "topics": ["events-track"],
        "contracts": {
            "Signed Up": {"schema": "contracts/signed_up/1-0-0.json", "mode": mode},
            "*": {"mode": "allow"},
        },
    }
    document = {
        "data_dir": str(tmp_path / "data"),
        "bus": {"embedded": {"durability": "never"}},
        "pipeline": {"destinations": [destination]},
    }
    path = tmp_path / "headwater.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def send(config_path: Path, properties: list[dict[str, Any]]) -> None:
    """Each ``properties`` as a ``Signed Up`` track call from the Segment SDK."""
    collector = CollectorConfig(sources=[SourceConfig(id="web", write_keys=[hash_key(KEY)])])
    bus = open_bus(load_config(config_path))
    with closing(bus), running_collector(bus, collector) as server:
        client = Client(KEY, host=server.url, sync_mode=True, timeout=10, max_retries=0)
        for i, props in enumerate(properties):
            client.track(f"user-{i}", "Signed Up", props)
        client.flush()


SIGNUPS = [
    {"plan": "pro", "seats": 3},
    {"plan": "gold", "seats": 0},  # two violations
    {"plan": "team"},  # seats missing
    {"plan": "pro", "seats": 1},
]


def test_broken_contracts_fail_with_their_paths_and_land_once_fixed(
    spark: Any, tmp_path: Path
) -> None:
    config = write(tmp_path, ["pro", "team"])
    send(config, SIGNUPS)
    run_pipeline(spark, config)
    assert rows(config, "select properties_seats from signups order by 1") == [(1,), (3,)]

    failed = cli_json(config, "failed", "list", "--destination", "warehouse")
    assert {f["step"] for f in failed} == {"contract"} and len(failed) == 2
    reasons = " | ".join(sorted(f["reason"] for f in failed))
    assert "signed_up/1-0-0" in reasons
    for path in ("/properties/plan", "/properties/seats", "/properties"):
        assert path in reasons, reasons
    assert "enum" in reasons and "minimum" in reasons and "required" in reasons

    # the fix: gold is a plan, seats may be missing or 0
    fixed = schema(["pro", "team", "gold"])
    fixed["properties"]["properties"]["required"] = ["plan"]
    fixed["properties"]["properties"]["properties"]["seats"]["minimum"] = 0
    (tmp_path / "contracts" / "signed_up" / "1-0-0.json").write_text(json.dumps(fixed))
    assert cli_json(config, "failed", "replay", "--destination", "warehouse") == [
        {"replayed": {"warehouse": 2}}
    ]
    run_pipeline(spark, config)
    got = rows(config, "select properties_plan, properties_seats from signups order by 1, 2")
    assert got == [("gold", 0), ("pro", 1), ("pro", 3), ("team", None)]
    again = run_pipeline(spark, config)
    assert again.queries[0].writer.written == 0


def test_warn_lands_events_with_their_violations(spark: Any, tmp_path: Path) -> None:
    config = write(tmp_path, ["pro", "team"], mode="warn")
    send(config, SIGNUPS[:2])
    run_pipeline(spark, config)
    got = rows(config, "select properties_plan, _hw_violations from signups order by 1")
    assert got[1][1] is None  # pro: no violation
    violations = json.loads(got[0][1])
    assert sorted(v["path"] for v in violations) == ["/properties/plan", "/properties/seats"]
    assert not cli_json(config, "failed", "list", "--destination", "warehouse")
