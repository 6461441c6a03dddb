"""The ``headwater`` command line, run in-process with click's CliRunner."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from headwater.bus import Message, TopicPartition, open_bus
from headwater.cli import log_cmds
from headwater.cli.main import cli
from headwater.config import load_config
from headwater.testing.kafka import KafkaCluster

pytestmark = pytest.mark.usefixtures("no_headwater_env")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        "data_dir: state\n"
        "bus:\n"
        "  embedded:\n"
        "    durability: never\n"
        "    default_partitions: 2\n"
        "    segment_bytes: 4096\n"
    )
    return path


@pytest.fixture
def run(config_file: Path) -> Iterator[RunCli]:
    yield RunCli(config_file)


class RunCli:
    def __init__(self, config_file: Path) -> None:
        self.config_file = config_file
        self.runner = CliRunner()

    def __call__(self, *args: str, input: str | bytes | None = None, code: int = 0) -> Result:
        result = self.runner.invoke(cli, ["--config", str(self.config_file), *args], input=input)
        assert result.exit_code == code, (result.output, result.stderr, result.exception)
        assert "Traceback" not in result.output
        return result

    def json_lines(self, *args: str) -> list[dict[str, object]]:
        result = self(*args, "--format", "json")
        return [json.loads(line) for line in result.stdout.splitlines()]


def lines(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"id": f"k{i % 3}", "n": i}) + "\n" for i in range(start, n))


# -- config check ---------------------------------------------------------------------------


def test_config_check_ok_shows_effective_settings(run: RunCli, config_file: Path) -> None:
    result = run("config", "check")
    assert result.stdout.startswith(f"OK: {config_file} is valid")
    assert str(config_file.parent / "state" / "log") in result.stdout
    assert "never" in result.stdout


def test_config_check_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["config", "check"])
    assert result.exit_code == 0
    assert "using the defaults" in result.stdout
    assert str(tmp_path / "data") in result.stdout


def test_config_check_names_key_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("bus:\n  embedded:\n    durability: sometimes\n    segmnt_bytes: 1\n")
    result = CliRunner().invoke(cli, ["config", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:3:17: bus.embedded.durability" in result.stderr
    assert f"{bad}:4:5: bus.embedded.segmnt_bytes" in result.stderr
    assert "error: HW-CFG-001" in result.stderr
    assert "Traceback" not in result.output

    result = CliRunner().invoke(cli, ["config", "check", str(bad), "--format", "json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert [(e["key"], e["line"]) for e in report["errors"]] == [
        ("bus.embedded.durability", 3),
        ("bus.embedded.segmnt_bytes", 4),
    ]


def test_config_check_json_and_env_override(config_file: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["config", "check", str(config_file), "--format", "json"],
        env={"HEADWATER_BUS__EMBEDDED__DURABILITY": "interval"},
    )
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["config"]["bus"]["embedded"]["durability"] == "interval"
    assert report["env_overrides"] == {
        "bus.embedded.durability": "HEADWATER_BUS__EMBEDDED__DURABILITY"
    }


def test_config_check_json_hides_secrets(tmp_path: Path) -> None:
    path = tmp_path / "headwater.yaml"
    path.write_text(
        "bus:\n"
        "  kafka:\n"
        "    client: {sasl.username: app, sasl.password: hunter2, ssl.key.pem: KEY}\n"
    )
    result = CliRunner().invoke(cli, ["config", "check", str(path), "--format", "json"])
    assert result.exit_code == 0, result.output
    client = json.loads(result.stdout)["config"]["bus"]["kafka"]["client"]
    assert client == {"sasl.username": "app", "sasl.password": "***", "ssl.key.pem": "***"}
    assert "hunter2" not in result.stdout


def test_config_check_bad_env_variable_is_named(config_file: Path) -> None:
    result = CliRunner().invoke(
        cli, ["config", "check", str(config_file)], env={"HEADWATER_BUS__NOPE": "1"}
    )
    assert result.exit_code == 1
    assert "HEADWATER_BUS__NOPE" in result.stderr


def test_config_option_on_group_command_and_env(tmp_path: Path, config_file: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("bus:\n  backend: kafka\n")
    runner = CliRunner()
    on_group = runner.invoke(cli, ["--config", str(other), "config", "check"])
    on_command = runner.invoke(cli, ["config", "check", "--config", str(other)])
    from_env = runner.invoke(cli, ["config", "check"], env={"HEADWATER_CONFIG": str(other)})
    command_wins = runner.invoke(
        cli, ["--config", str(config_file), "config", "check", "-c", str(other)]
    )
    for result in (on_group, on_command, from_env, command_wins):
        assert result.exit_code == 0, result.output
        assert f"OK: {other} is valid" in result.stdout
        assert "bus.kafka.bootstrap_servers" in result.stdout


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--config", str(tmp_path / "nope.yaml"), "log", "topics"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: HW-CFG-001: ")
    assert "nope.yaml" in result.stderr


# -- append and view ------------------------------------------------------------------------


def test_append_then_view(run: RunCli) -> None:
    result = run("log", "append", "events", "--key-field", "id", input=lines(6))
    assert "appended 6 records to events" in result.stdout

    records = run.json_lines("log", "view", "events")
    assert len(records) == 6
    assert sorted(json.loads(str(r["value"]))["n"] for r in records) == list(range(6))
    first = records[0]
    assert set(first) >= {"topic", "partition", "offset", "timestamp", "key", "headers", "value"}
    assert first["value_encoding"] == "utf8"
    assert first["key_encoding"] == "utf8"
    assert str(first["time"]).endswith("Z")
    # Records with the same key share a partition, in append order.
    by_key: dict[object, set[object]] = {}
    for r in records:
        by_key.setdefault(r["key"], set()).add(r["partition"])
    assert all(len(parts) == 1 for parts in by_key.values())

    text = run("log", "view", "events").stdout
    assert "key: k0" in text
    assert 'value: {"id": "k0", "n": 0}' in text


def test_append_value_is_the_line_as_given(run: RunCli) -> None:
    line = '{ "b" : 2,   "a":1 }'
    run("log", "append", "raw", "--partition", "1", input=line + "\r\n\n")
    [record] = run.json_lines("log", "view", "raw")
    assert record["value"] == line
    assert record["partition"] == 1
    assert record["key"] is None


def test_append_bad_lines_appends_nothing(run: RunCli) -> None:
    good = lines(3)
    text = good + "not json\n" + '{"no_id": 1}\n' + '{"id": null}\n'
    result = run("log", "append", "events", "--key-field", "id", input=text, code=1)
    assert "line 4: invalid JSON" in result.stderr
    assert "line 5: missing key field 'id'" in result.stderr
    assert "line 6: key field 'id' is null" in result.stderr
    assert "error: HW-OPS-001: 3 bad lines on stdin; nothing was appended" in result.stderr

    result = run(
        "log", "append", "events", "--key-field", "id", "--format", "json", input=text, code=1
    )
    report = json.loads(result.stdout)
    assert [e["line"] for e in report["errors"]] == [4, 5, 6]
    # Nothing reached the log (it may not even exist yet).
    topics = run.runner.invoke(cli, ["--config", str(run.config_file), "log", "topics"])
    assert "events" not in topics.stdout


def test_append_json_summary_and_nested_key(run: RunCli) -> None:
    text = "".join(json.dumps({"user": {"id": i % 2}, "n": i}) + "\n" for i in range(4))
    result = run("log", "append", "t", "-k", "user.id", "--format", "json", input=text)
    report = json.loads(result.stdout)
    assert report["appended"] == 4
    assert sum(p["count"] for p in report["partitions"]) == 4
    keys = {r["key"] for r in run.json_lines("log", "view", "t")}
    assert keys == {"0", "1"}


def test_append_to_missing_partition_is_refused(run: RunCli) -> None:
    result = run("log", "append", "events", "--partition", "7", input=lines(2), code=1)
    assert "error: HW-BUS-003" in result.stderr


def test_view_range_is_exclusive_and_limited(run: RunCli) -> None:
    run("log", "append", "events", "--partition", "0", input=lines(10))
    offsets = [r["offset"] for r in run.json_lines("log", "view", "events", "-p", "0")]
    assert offsets == list(range(10))
    window = run.json_lines("log", "view", "events", "-p", "0", "--from", "3", "--to", "7")
    assert [r["offset"] for r in window] == [3, 4, 5, 6]
    limited = run.json_lines("log", "view", "events", "--from", "2", "--limit", "3")
    assert [(r["partition"], r["offset"]) for r in limited] == [(0, 2), (0, 3), (0, 4)]
    result = run("log", "view", "events", "--from", "5", "--to", "2", code=2)
    assert "--to" in result.stderr


def test_view_reads_in_chunks(run: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_cmds, "READ_CHUNK_RECORDS", 3)
    run("log", "append", "events", "--partition", "1", input=lines(11))
    records = run.json_lines("log", "view", "events", "-p", "1", "--from", "1")
    assert [r["offset"] for r in records] == list(range(1, 11))


def test_view_binary_values_as_base64(run: RunCli, config_file: Path) -> None:
    config = load_config(config_file, env={})
    with open_bus(config) as bus:
        bus.append(
            "bin",
            [
                Message(
                    value=b"\xff\x00\x01",
                    key=b"\xfe",
                    headers=(("ct", b"text/plain"), ("raw", b"\x80")),
                    timestamp=1_700_000_000_123,
                    partition=0,
                ),
                Message(value="héllo\nworld".encode(), key=b"k", partition=0),
            ],
        ).result()

    first, second = run.json_lines("log", "view", "bin")
    assert first["value"] == base64.b64encode(b"\xff\x00\x01").decode()
    assert first["value_encoding"] == "base64"
    assert (first["key"], first["key_encoding"]) == ("/g==", "base64")
    assert first["headers"] == [
        {"name": "ct", "value": "text/plain", "value_encoding": "utf8"},
        {"name": "raw", "value": "gA==", "value_encoding": "base64"},
    ]
    assert first["timestamp"] == 1_700_000_000_123
    assert first["time"] == "2023-11-14T22:13:20.123Z"
    assert (second["value"], second["value_encoding"]) == ("héllo\nworld", "utf8")

    text = run("log", "view", "bin").stdout
    assert "bin[0]@0  2023-11-14T22:13:20.123Z (1700000000123)" in text
    assert "value (base64): /wAB" in text
    assert "header ct: text/plain" in text
    assert "header raw (base64): gA==" in text
    assert "value: héllo\n    world" in text


def test_unknown_topic_is_a_clean_error(run: RunCli) -> None:
    run("log", "append", "events", input=lines(1))
    result = run("log", "view", "nope", code=1)
    assert result.stderr.startswith("error: HW-BUS-002: ")
    result = run("log", "view", "events", "--partition", "9", code=1)
    assert result.stderr.startswith("error: HW-BUS-003: ")


def test_topics(run: RunCli) -> None:
    run("log", "append", "a", "--partition", "0", input=lines(3))
    run("log", "append", "b", "--partition", "1", input=lines(2))
    [report] = run.json_lines("log", "topics")
    topics = {t["name"]: t for t in report["topics"]}  # type: ignore[union-attr]
    assert topics["a"]["records"] == 3
    assert topics["b"]["watermarks"] == [
        {"partition": 0, "low": 0, "high": 0, "records": 0},
        {"partition": 1, "low": 0, "high": 2, "records": 2},
    ]
    text = run("log", "topics").stdout
    assert text.splitlines()[0].split() == ["TOPIC", "PARTITIONS", "LOW", "HIGH", "RECORDS"]


# -- offsets --------------------------------------------------------------------------------


def test_set_offset_and_offsets(run: RunCli) -> None:
    run("log", "append", "events", "--partition", "0", input=lines(16))
    result = run("log", "set-offset", "--group", "c0", "events", "0", "9")
    assert "committed offset none -> 9 (lag 7)" in result.stdout
    # Mark offset 9 acknowledged without processing it.
    result = run("log", "set-offset", "--group", "c0", "events", "0", "10")
    assert "9 -> 10 (lag 6)" in result.stdout

    [report] = run.json_lines("log", "offsets")
    [group] = report["groups"]  # type: ignore[misc]
    assert group["group"] == "c0"
    assert group["lag"] == 6
    assert group["partitions"] == [
        {"topic": "events", "partition": 0, "committed": 10, "low": 0, "high": 16, "lag": 6},
        {"topic": "events", "partition": 1, "committed": None, "low": 0, "high": 0, "lag": 0},
    ]
    text = run("log", "offsets", "--group", "c0").stdout
    assert text.splitlines()[1].split() == ["c0", "events", "0", "10", "16", "6"]

    run("log", "set-offset", "-g", "c0", "events", "0", "earliest")
    run("log", "set-offset", "-g", "c0", "events", "0", "latest")
    [report] = run.json_lines("log", "offsets", "--group", "c0")
    assert report["groups"][0]["lag"] == 0  # type: ignore[index]


def test_set_offset_validates(run: RunCli) -> None:
    run("log", "append", "events", "--partition", "0", input=lines(4))
    result = run("log", "set-offset", "--group", "g", "events", "0", "5", code=1)
    assert result.stderr.startswith("error: HW-BUS-004: ")
    assert "[0, 4]" in result.stderr
    result = run("log", "set-offset", "--group", "g", "events", "2", "0", code=1)
    assert result.stderr.startswith("error: HW-BUS-003: ")
    result = run("log", "set-offset", "--group", "g", "nope", "0", "0", code=1)
    assert result.stderr.startswith("error: HW-BUS-002: ")
    run("log", "set-offset", "--group", "g", "events", "0", "x", code=2)


def test_offsets_unknown_group(run: RunCli) -> None:
    run("log", "append", "events", input=lines(1))
    result = run("log", "offsets", "--group", "ghost", code=1)
    assert result.stderr.startswith("error: HW-OPS-002: ")


# -- compaction -----------------------------------------------------------------------------


def test_compact(run: RunCli, config_file: Path) -> None:
    value = "x" * 300
    # A batch never spans segments: append in several batches so that segments close.
    for batch in range(6):
        text = "".join(
            json.dumps({"id": f"k{i % 2}", "v": value}) + "\n"
            for i in range(batch * 10, batch * 10 + 10)
        )
        run("log", "append", "events", "--partition", "0", "-k", "id", input=text)
    run("log", "set-offset", "--group", "w", "events", "0", "60")

    [report] = run.json_lines("log", "compact", "events")
    results = report["results"]
    assert isinstance(results, list)
    part0 = next(r for r in results if r["partition"] == 0)
    assert part0["segments"] > 0
    assert part0["records_after"] < part0["records_before"]

    # The latest record of each key survives; offsets are unchanged.
    records = run.json_lines("log", "view", "events", "-p", "0")
    offsets = [r["offset"] for r in records]
    assert offsets == sorted(offsets)
    assert {58, 59} <= set(offsets)
    assert len(records) == 60 - (part0["records_before"] - part0["records_after"])
    text = run("log", "compact").stdout
    assert text  # a table or "nothing to compact"


# -- the write lock -------------------------------------------------------------------------


def test_read_commands_work_while_a_writer_holds_the_log(run: RunCli, config_file: Path) -> None:
    run("log", "append", "events", "--partition", "0", input=lines(3))
    config = load_config(config_file, env={})
    with open_bus(config) as bus:
        bus.commit("c0", {TopicPartition("events", 0): 1})
        bus.flush()
        assert len(run.json_lines("log", "view", "events")) == 3
        run("log", "topics")
        run("log", "offsets")
        result = run("log", "append", "events", input=lines(1), code=1)
        assert result.stderr.startswith("error: HW-BUS-007: ")


# -- the Kafka backend ----------------------------------------------------------------------


@pytest.mark.kafka
def test_against_kafka(tmp_path: Path, kafka_broker: KafkaCluster) -> None:
    broker = kafka_broker
    config_file = tmp_path / "kafka.yaml"
    config_file.write_text(
        f"data_dir: state\nbus:\n  backend: kafka\n  kafka:\n"
        f"    bootstrap_servers: '{broker.bootstrap_servers}'\n"
    )
    run = RunCli(config_file)
    topic = f"cli-{tmp_path.name}".replace("_", "-")[:60]
    run("log", "append", topic, "--partition", "0", "-k", "id", input=lines(5))
    records = run.json_lines("log", "view", topic, "-p", "0")
    assert [r["offset"] for r in records] == [0, 1, 2, 3, 4]
    assert records[0]["key"] == "k0"
    run("log", "set-offset", "--group", "cli-g", topic, "0", "3")
    [report] = run.json_lines("log", "offsets", "--group", "cli-g")
    rows = report["groups"][0]["partitions"]  # type: ignore[index]
    assert {"topic": topic, "partition": 0, "committed": 3, "low": 0, "high": 5, "lag": 2} in rows
    assert "cleanup.policy=compact" in run("log", "compact").stdout
