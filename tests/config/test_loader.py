"""load_config: the file, the defaults, env overrides, and errors that name key, file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field, ValidationError

from headwater.config import ConfigIssue, InvalidConfig, load_config, read_config
from headwater.config.base import Section
from headwater.config.loader import _issues_from_validation
from headwater.errors import ConfigError


def write(tmp_path: Path, text: str, name: str = "headwater.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def issues_of(exc: pytest.ExceptionInfo[ConfigError]) -> list[ConfigIssue]:
    assert isinstance(exc.value, InvalidConfig)
    assert exc.value.code == "HW-CFG-001"
    return list(exc.value.issues)


def test_good_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "data_dir: /srv/hw\n"
        "bus:\n"
        "  backend: embedded\n"
        "  embedded:\n"
        "    durability: interval\n"
        "    flush_interval_ms: 50\n"
        "    retention:\n"
        "      bytes: 1000000\n",
    )
    config = load_config(path, env={})
    assert config.data_dir == Path("/srv/hw")
    assert config.bus.embedded.durability == "interval"
    assert config.bus.embedded.flush_interval_ms == 50
    assert config.bus.embedded.retention.bytes == 1_000_000
    assert config.log_dir() == Path("/srv/hw/log")


def test_defaults_without_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loaded = read_config(env={})
    assert loaded.file is None
    assert loaded.config.data_dir == tmp_path / "data"
    assert loaded.config.log_dir() == tmp_path / "data" / "log"
    assert loaded.config.bus.backend == "embedded"
    assert loaded.config.bus.embedded.durability == "always"


def test_reads_headwater_yaml_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "bus:\n  embedded:\n    durability: never\n")
    monkeypatch.chdir(tmp_path)
    loaded = read_config(env={})
    assert loaded.file == Path("headwater.yaml")
    assert loaded.config.bus.embedded.durability == "never"


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "# nothing set\n"), env={})
    assert config.bus.backend == "embedded"


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert str(path) in str(exc.value)
    assert "not found" in str(exc.value)


def test_unknown_key_names_line_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  embedded:\n    durabilty: never\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    [issue] = issues_of(exc)
    assert issue.key == "bus.embedded.durabilty"
    assert (issue.file, issue.line, issue.column) == (str(path), 3, 5)
    assert "did you mean 'durability'" in issue.message
    assert f"{path}:3:5: bus.embedded.durabilty" in str(exc.value)


def test_wrong_type_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "data_dir: ./d\nbus:\n  embedded:\n    segment_bytes: lots\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    [issue] = issues_of(exc)
    assert issue.key == "bus.embedded.segment_bytes"
    assert (issue.line, issue.column) == (4, 20)
    assert "'lots'" in issue.message


def test_bad_enum_lists_choices(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  backend: rabbit\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    [issue] = issues_of(exc)
    assert issue.key == "bus.backend"
    assert issue.line == 2
    assert "'embedded' or 'kafka'" in issue.message


def test_every_bad_key_is_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bus:\n"
        "  embeded: {}\n"
        "  embedded:\n"
        "    durability: sometimes\n"
        "    retention:\n"
        "      bytes: -1\n"
        "  kafka:\n"
        "    client:\n"
        "      security.protocol: [SSL]\n",
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    found = {(i.key, i.line) for i in issues_of(exc)}
    assert found == {
        ("bus.embeded", 2),
        ("bus.embedded.durability", 4),
        ("bus.embedded.retention.bytes", 6),
        ("bus.kafka.client['security.protocol']", 9),
    }


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  backend: [embedded\n  kafka: {}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    [issue] = issues_of(exc)
    assert issue.file == str(path)
    assert issue.line is not None and issue.line >= 2
    assert "invalid YAML" in issue.message


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- bus\n- data_dir\n"), env={})


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  backend: kafka\nbus:\n  backend: embedded\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    [issue] = issues_of(exc)
    assert (issue.key, issue.line) == ("bus", 3)
    assert "duplicate" in issue.message


def test_env_overrides_nested_and_top_level(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  embedded:\n    durability: always\n")
    env = {
        "HEADWATER_BUS__BACKEND": "kafka",
        "HEADWATER_BUS__EMBEDDED__DURABILITY": "never",
        "HEADWATER_BUS__EMBEDDED__FLUSH_INTERVAL_MS": "25",
        "HEADWATER_BUS__EMBEDDED__AUTO_CREATE_TOPICS": "false",
        "HEADWATER_DATA_DIR": "/x",
        "HEADWATER_BUS__KAFKA__CLIENT": "{security.protocol: SASL_SSL}",
        "HEADWATER_BUS__KAFKA__CLIENT__SASL.MECHANISM": "PLAIN",
        "HEADWATER_CONFIG": "ignored: names the file for the command line",
        "OTHER": "x",
    }
    loaded = read_config(path, env=env)
    config = loaded.config
    assert config.bus.backend == "kafka"
    assert config.bus.embedded.durability == "never"
    assert config.bus.embedded.flush_interval_ms == 25
    assert config.bus.embedded.auto_create_topics is False
    assert config.data_dir == Path("/x")
    assert config.bus.kafka.client == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}
    assert loaded.env_overrides["bus.embedded.durability"] == "HEADWATER_BUS__EMBEDDED__DURABILITY"


def test_env_text_settings_take_the_value_as_given(tmp_path: Path) -> None:
    # "12:30" would be a YAML 1.1 number, "on" a boolean: text settings keep the string.
    config = load_config(write(tmp_path, ""), env={"HEADWATER_BUS__KAFKA__BOOTSTRAP_SERVERS": "on"})
    assert config.bus.kafka.bootstrap_servers == "on"


def test_env_variable_naming_no_setting_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, ""), env={"HEADWATER_BUS__EMBEDED__DURABILITY": "never"})
    [issue] = issues_of(exc)
    assert issue.env == "HEADWATER_BUS__EMBEDED__DURABILITY"
    assert "did you mean 'embedded'" in issue.message
    assert "HEADWATER_BUS__EMBEDED__DURABILITY" in str(exc.value)


def test_env_bad_value_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  embedded:\n    durability: always\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={"HEADWATER_BUS__EMBEDDED__DURABILITY": "sometimes"})
    [issue] = issues_of(exc)
    assert issue.key == "bus.embedded.durability"
    assert issue.env == "HEADWATER_BUS__EMBEDDED__DURABILITY"
    assert issue.line is None
    assert "env HEADWATER_BUS__EMBEDDED__DURABILITY: bus.embedded.durability" in str(exc.value)


def test_env_below_a_single_setting_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a single setting"):
        load_config(write(tmp_path, ""), env={"HEADWATER_DATA_DIR__X": "1"})


def test_relative_paths_resolve_against_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = write(conf_dir, "data_dir: state\nbus:\n  embedded:\n    path: ../logs\n")
    config = load_config(path, env={})
    assert config.data_dir == conf_dir / "state"
    assert config.bus.embedded.path == tmp_path / "logs"

    # Defaults follow the file too; env values follow the working directory.
    config = load_config(write(conf_dir, "", "empty.yaml"), env={})
    assert config.data_dir == conf_dir / "data"
    config = load_config(path, env={"HEADWATER_DATA_DIR": "mine"})
    assert config.data_dir == elsewhere / "mine"


def test_relative_path_argument_and_default_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    write(tmp_path / "conf", "bus:\n  embedded:\n    path: log\n")
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("conf/headwater.yaml"), env={})
    assert config.bus.embedded.path == tmp_path / "conf" / "log"
    assert config.log_dir() == tmp_path / "conf" / "log"


def test_loading_does_not_create_directories(tmp_path: Path) -> None:
    load_config(write(tmp_path, "data_dir: not/yet\n"), env={})
    assert not (tmp_path / "not").exists()


# -- shapes later sections will have: lists, named sections, tagged choices ---------------------


class _Postgres(Section):
    type: Literal["postgres"] = "postgres"
    host: str = "localhost"
    port: int = 5432


class _Files(Section):
    type: Literal["files"] = "files"
    path: Path = Path("out")


class _Root(Section):
    writers: dict[str, Annotated[_Postgres | _Files, Field(discriminator="type")]] = Field(
        default_factory=dict
    )
    plain: dict[str, _Postgres | _Files] = Field(default_factory=dict)
    tags: list[int] = Field(default_factory=list)


def _issues_for(text: str) -> list[tuple[str | None, int | None, str]]:
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    with pytest.raises(ValidationError) as exc:
        _Root.model_validate(data)
    issues = _issues_from_validation(exc.value, node, "f.yaml", {}, _Root)
    return [(i.key, i.line, i.message) for i in issues]


def test_tagged_union_errors_name_the_key() -> None:
    text = "writers:\n  wh:\n    type: postgres\n    port: many\n    hots: x\n"
    found = _issues_for(text)
    assert [(key, line) for key, line, _ in found] == [
        ("writers.wh.port", 4),
        ("writers.wh.hots", 5),
    ]
    assert "did you mean 'host'" in found[1][2]


def test_plain_union_and_list_errors_name_the_key() -> None:
    text = "plain:\n  a:\n    port: many\ntags:\n  - 1\n  - two\n"
    found = {(key, line) for key, line, _ in _issues_for(text)}
    assert ("tags[1]", 6) in found
    assert all(key is not None and key.startswith(("plain.a", "tags")) for key, _ in found)
    assert all(line in (3, 6) for _, line in found)
