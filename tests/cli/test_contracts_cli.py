"""``headwater contracts check`` through the command line's entry point (click's CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from headwater.cli.main import cli

pytestmark = pytest.mark.usefixtures("no_headwater_env")

SIGNUP = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["userId"],
    "properties": {
        "properties": {
            "type": "object",
            "properties": {
                "plan": {"enum": ["free", "pro"]},
                "items": {"type": "array", "items": {"type": "number"}},
            },
        }
    },
}
GOOD = {"event": "signup", "userId": "u1", "properties": {"plan": "pro"}}
BAD = {"event": "signup", "properties": {"plan": "gold", "items": [1, "two"]}}
PAGE = {"type": "page", "event_type": "page_view"}
DESTINATION = """\
    - id: {id}
      type: duckdb
      contracts:
        signup: {{schema: contracts/signup/1-0-0.json, mode: enforce}}
        "*": {{mode: {unknown}}}
"""


def config(folder: Path, *destinations: tuple[str, str], schema: Any = SIGNUP) -> Path:
    """A config with a destination per ``(id, "*" mode)``, the signup schema beside it."""
    contract = folder / "contracts" / "signup" / "1-0-0.json"
    contract.parent.mkdir(parents=True)
    contract.write_text(schema if isinstance(schema, str) else json.dumps(schema))
    path = folder / "headwater.yaml"
    path.write_text(
        "pipeline:\n  destinations:\n"
        + "".join(DESTINATION.format(id=i, unknown=u) for i, u in destinations)
    )
    return path


def events_file(folder: Path, *events: Any) -> Path:
    path = folder / "events.jsonl"
    path.write_text("".join(e if isinstance(e, str) else json.dumps(e) + "\n" for e in events))
    return path


def check(config_path: Path, *args: str, code: int, input: str | None = None) -> Result:
    result = CliRunner().invoke(
        cli, ["contracts", "check", "--config", str(config_path), *args], input=input
    )
    assert result.exit_code == code, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result


def test_text_prints_every_violation_by_line_and_exits_1_on_a_reject(tmp_path: Path) -> None:
    conf = config(tmp_path, ("warehouse", "warn"))
    events = events_file(tmp_path, GOOD, BAD, "\n", PAGE, "{oops\n")
    out = check(conf, str(events), code=1).stdout.splitlines()
    assert out[0].split() == ["LINE", "TYPE", "CONTRACT", "ACTION", "PATH", "KEYWORD", "MESSAGE"]
    rows = [line.split(maxsplit=6) for line in out[1:-1]]
    assert [r[:6] for r in rows] == [
        ["2", "signup", "signup/1-0-0", "reject", "/", "required"],
        ["2", "signup", "signup/1-0-0", "reject", "/properties/plan", "enum"],
        ["2", "signup", "signup/1-0-0", "reject", "/properties/items/1", "type"],
        ["4", "page_view", "-", "warn", "/", "contract"],
        ["5", "-", "-", "reject", "/", "json"],
    ]
    assert rows[1][6] == '"gold" is not one of "free" or "pro"'
    assert out[-1] == "4 event(s) against warehouse's contracts: 1 pass, 1 warn, 2 reject"


def test_json_with_type_checks_every_line_against_that_contract(tmp_path: Path) -> None:
    conf = config(tmp_path, ("warehouse", "allow"))
    events = events_file(tmp_path, GOOD, PAGE)
    document = json.loads(
        check(conf, "--type", "signup", str(events), "--format", "json", code=1).stdout
    )
    assert document["destination"] == "warehouse"
    assert document["summary"] == {"events": 2, "pass": 1, "warn": 0, "reject": 1}
    first, second = document["results"]
    assert first == {
        "line": 1,
        "type": "signup",
        "contract": "signup/1-0-0",
        "action": "pass",
        "violations": [],
    }
    assert second["violations"] == [
        {"path": "", "keyword": "required", "message": '"userId" is a required property'}
    ]


def test_stdin_with_nothing_rejected_exits_0(tmp_path: Path) -> None:
    conf = config(tmp_path, ("warehouse", "warn"))
    lines = json.dumps(GOOD) + "\n" + json.dumps(PAGE) + "\n"
    result = check(conf, "-", code=0, input=lines)
    assert result.stdout.endswith(
        "2 event(s) against warehouse's contracts: 1 pass, 1 warn, 0 reject\n"
    )


def test_destination_is_chosen_when_several_have_contracts(tmp_path: Path) -> None:
    conf = config(tmp_path, ("lake", "allow"), ("warehouse", "reject"))
    events = events_file(tmp_path, PAGE)
    result = check(conf, str(events), code=1)
    assert (
        "several destinations have contracts (lake, warehouse): choose one with --destination"
        in (result.stderr)
    )
    check(conf, "--destination", "lake", str(events), code=0)
    check(conf, "--destination", "warehouse", str(events), code=1)
    result = check(conf, "--destination", "nope", str(events), code=1)
    assert "no destination named 'nope'" in result.stderr


def test_a_bad_schema_file_is_an_error_naming_key_and_file(tmp_path: Path) -> None:
    conf = config(tmp_path, ("warehouse", "allow"), schema='{"type": "strnig"}')
    result = check(conf, str(events_file(tmp_path, GOOD)), code=1)
    assert result.stdout == ""
    assert result.stderr.startswith(
        "error: HW-PIPE-502: pipeline.destinations[0].contracts.signup.schema: "
        f"{tmp_path / 'contracts' / 'signup' / '1-0-0.json'}: is not a valid draft 2020-12 schema"
    )


def test_source_picks_that_sources_contracts_first(tmp_path: Path) -> None:
    conf = config(tmp_path, ("warehouse", "allow"))
    text = conf.read_text()
    conf.write_text(text + '        app_others: {type: "*", source: app, mode: reject}\n')
    events = events_file(tmp_path, GOOD, PAGE)
    check(conf, str(events), code=0)  # no source: page is allowed
    out = check(conf, "--source", "app", str(events), "--format", "json", code=1).stdout
    assert [r["action"] for r in json.loads(out)["results"]] == ["pass", "reject"]
