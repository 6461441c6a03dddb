"""Data contracts (``headwater.pipeline.contracts``): modes, violations, schema files, the cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from headwater.config import InvalidConfig, load_config
from headwater.pipeline.contracts import (
    ContractConfig,
    ContractConfigError,
    Contracts,
    Verdict,
    Violation,
    contracts_spec,
    event_type_of,
    reason,
    violations_json,
)

SIGNUP = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["event", "userId", "properties"],
    "properties": {
        "event": {"const": "signup"},
        "userId": {"type": "string"},
        "timestamp": {"type": "string", "format": "date-time"},
        "context": {
            "type": "object",
            "properties": {
                "traits": {
                    "type": "object",
                    "properties": {"email": {"type": "string", "format": "email"}},
                }
            },
        },
        "properties": {
            "type": "object",
            "required": ["plan"],
            "properties": {
                "plan": {"enum": ["free", "pro"]},
                "products": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["sku"],
                        "properties": {"price": {"type": "number", "minimum": 0}},
                    },
                },
            },
        },
    },
}
GOOD = {
    "event": "signup",
    "userId": "u1",
    "timestamp": "2026-11-30T10:00:00Z",
    "context": {"traits": {"email": "a@example.com"}},
    "properties": {"plan": "pro", "products": [{"sku": "A", "price": 3}]},
}


def bad_event() -> dict[str, Any]:
    """Six violations: missing userId, a bad format, an enum, and three inside array items."""
    event = copy.deepcopy(GOOD)
    del event["userId"]
    event["timestamp"] = "yesterday"
    event["properties"]["plan"] = "gold"
    event["properties"]["products"] = [{"sku": "A", "price": -1}, {"price": "12.50"}]
    return event


def write_schema(folder: Path, name: str, schema: Any) -> Path:
    path = folder / "contracts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schema) if not isinstance(schema, str) else schema)
    return path


def compiled(tmp_path: Path, contracts: dict[str, dict[str, Any]]) -> Contracts:
    """``Contracts`` for ``contracts`` (the config's shape), the signup schema on disk."""
    path = write_schema(tmp_path, "signup/1-0-0.json", SIGNUP)
    config = {
        k: ContractConfig.model_validate({**v, "schema": path} if v.get("schema") else v)
        for k, v in contracts.items()
    }
    return Contracts.compile(contracts_spec(config))


ENFORCE = {"signup": {"schema": True, "mode": "enforce"}}


# -- verdicts ---------------------------------------------------------------------------------


def test_a_valid_event_passes_under_its_contract(tmp_path: Path) -> None:
    verdict = compiled(tmp_path, ENFORCE).check("signup", GOOD)
    assert verdict == Verdict("pass", "signup/1-0-0")


def test_enforce_rejects_with_every_violation_path_and_keyword(tmp_path: Path) -> None:
    verdict = compiled(tmp_path, ENFORCE).check("signup", bad_event())
    assert verdict.action == "reject"
    assert verdict.contract == "signup/1-0-0"
    assert sorted((v.path, v.keyword) for v in verdict.violations) == [
        ("", "required"),
        ("/properties/plan", "enum"),
        ("/properties/products/0/price", "minimum"),
        ("/properties/products/1", "required"),
        ("/properties/products/1/price", "type"),
        ("/timestamp", "format"),
    ]
    plan = next(v for v in verdict.violations if v.keyword == "enum")
    assert "gold" in plan.message


def test_warn_lands_the_event_with_its_violations(tmp_path: Path) -> None:
    contracts = compiled(tmp_path, {"signup": {"schema": True, "mode": "warn"}})
    event = copy.deepcopy(GOOD)
    event["context"]["traits"]["email"] = "not an email"
    verdict = contracts.check("signup", event)
    assert verdict.action == "warn"
    assert violations_json(verdict) == [
        {
            "path": "/context/traits/email",
            "keyword": "format",
            "message": '"not an email" is not a "email"',
        }
    ]


def test_reason_is_one_line_naming_contract_paths_and_keywords(tmp_path: Path) -> None:
    event = copy.deepcopy(GOOD)
    event["properties"]["plan"] = "gold"
    del event["userId"]
    text = reason(compiled(tmp_path, ENFORCE).check("signup", event))
    assert text.startswith("contract signup/1-0-0: ")
    assert "/: " in text and "(required)" in text
    assert '/properties/plan: "gold" is not one of' in text and text.endswith("(enum)")
    assert "\n" not in text


@pytest.mark.parametrize(
    ("unknown", "action"),
    [(None, "pass"), ("allow", "pass"), ("warn", "warn"), ("reject", "reject")],
)
def test_types_with_no_contract(tmp_path: Path, unknown: str | None, action: str) -> None:
    config = dict(ENFORCE)
    if unknown is not None:
        config["*"] = {"mode": unknown}
    contracts = compiled(tmp_path, config)
    for event_type in ("page", None):
        verdict = contracts.check(event_type, {"anything": 1})
        assert verdict.action == action
        assert verdict.contract is None
        if action == "pass":
            assert verdict.violations == ()
        else:
            [why] = verdict.violations
            assert why.keyword == "contract"
            assert (repr(event_type) if event_type else "no type") in why.message
            assert reason(verdict) == why.message
    assert contracts.check("signup", GOOD).action == "pass"  # named types keep their contract


def test_a_sources_own_contracts_come_first(tmp_path: Path) -> None:
    contracts = compiled(
        tmp_path,
        {
            "signup": {"schema": True, "mode": "enforce"},
            "mobile_signup": {"type": "signup", "source": "mobile", "schema": True, "mode": "warn"},
            "mobile_others": {"type": "*", "source": "mobile", "mode": "reject"},
        },
    )
    assert contracts.by_source
    assert contracts.check("signup", bad_event(), "web").action == "reject"
    assert contracts.check("signup", bad_event(), None).action == "reject"
    assert contracts.check("signup", bad_event(), "mobile").action == "warn"
    assert contracts.check("signup", GOOD, "mobile") == Verdict("pass", "signup/1-0-0")
    assert contracts.check("page", {}, "mobile").action == "reject"  # the source's "*"
    assert contracts.check("page", {}, "web").action == "pass"  # every source's "*": allow
    assert not compiled(tmp_path, ENFORCE).by_source


def test_check_many_parses_and_judges_each_text(tmp_path: Path) -> None:
    contracts = compiled(tmp_path, {**ENFORCE, "*": {"mode": "warn"}})
    texts = [orjson.dumps(GOOD).decode(), orjson.dumps(bad_event()).decode(), "{nope", "{}"]
    verdicts = contracts.check_many(["signup", "signup", "signup", "page"], texts)
    assert [v.action for v in verdicts] == ["pass", "reject", "reject", "warn"]
    assert verdicts[1] == contracts.check("signup", bad_event())
    assert verdicts[2].violations[0].keyword == "json"


def test_event_type_of() -> None:
    assert event_type_of({"event": "signup", "event_type": "x"}, "track") == "signup"
    assert event_type_of({"event": 3, "event_type": "checkout"}, "track") == "checkout"
    assert event_type_of({"event": "", "type": "page"}, "page") == "page"
    assert event_type_of({}, None) is None
    assert event_type_of({}, "") is None


def test_pointer_escapes_slash_and_tilde(tmp_path: Path) -> None:
    schema = {"properties": {"a/b": {"properties": {"c~d": {"type": "integer"}}}}}
    path = write_schema(tmp_path, "odd/1-0-0.json", schema)
    contracts = Contracts.compile(contracts_spec({"odd": ContractConfig(schema=path)}))
    [v] = contracts.check("odd", {"a/b": {"c~d": "x"}}).violations
    assert v == Violation("/a~1b/c~0d", "type", '"x" is not of type "integer"')


# -- schema files -----------------------------------------------------------------------------


def test_ref_to_a_sibling_file_is_bundled_into_the_spec(tmp_path: Path) -> None:
    write_schema(
        tmp_path,
        "signup/address.json",
        {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    )
    path = write_schema(
        tmp_path, "signup/2-0-0.json", {"properties": {"address": {"$ref": "address.json"}}}
    )
    spec = contracts_spec({"signup": ContractConfig(schema=path)})
    (tmp_path / "contracts" / "signup" / "address.json").unlink()  # workers read no files
    spec = orjson.loads(orjson.dumps(spec))  # it travels as JSON
    verdict = Contracts.compile(spec).check("signup", {"address": {"zip": "abc"}})
    assert verdict.contract == "signup/2-0-0"
    assert [(v.path, v.keyword) for v in verdict.violations] == [("/address/zip", "pattern")]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not a JSON Schema (an object)"),
        ('{"type": "strnig"}', "is not a valid draft 2020-12 schema: at /type"),
        ('{"$schema": "http://json-schema.org/draft-07/schema#"}', "contracts are draft 2020-12"),
        ('{"$ref": "missing.json"}', "cannot be compiled"),
        ('{"$ref": "https://example.com/s.json"}', "cannot be compiled"),
        ('{"pattern": "(unclosed"}', "cannot be compiled"),
    ],
)
def test_bad_schema_files_name_the_key_and_the_file(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "contracts" / "signup" / "1-0-0.json"
    if content is not None:
        write_schema(tmp_path, "signup/1-0-0.json", content)
    with pytest.raises(ContractConfigError) as exc:
        contracts_spec(
            {"signup": ContractConfig(schema=path)}, key="pipeline.destinations[0].contracts"
        )
    assert exc.value.code == "HW-PIPE-502"
    assert exc.value.message.startswith(
        f"pipeline.destinations[0].contracts.signup.schema: {path}: "
    )
    assert says in exc.value.message


# -- the config -------------------------------------------------------------------------------


def config_file(folder: Path, contracts: str) -> Path:
    path = folder / "headwater.yaml"
    path.write_text(
        "pipeline:\n  destinations:\n    - id: warehouse\n      type: duckdb\n"
        f"      contracts:\n{contracts}"
    )
    return path


@pytest.mark.parametrize(
    ("contracts", "says"),
    [
        ('        "*": {mode: enforce}\n', '"*" (types with no contract) takes mode allow'),
        ('        "*": {mode: warn, schema: a.json}\n', '"*" (types with no contract) takes no'),
        ("        signup: {mode: warn}\n", "'signup': mode 'warn' needs schema"),
        ("        signup: {}\n", "'signup': mode 'enforce' needs schema"),
        ("        signup: {mode: allow}\n", "'signup': a contract takes mode enforce or warn"),
        ("        signup: {mode: reject, schema: a.json}\n", "mode 'reject' is for \"*\""),
        ("        signup: {mode: block, schema: a.json}\n", "'enforce', 'warn', 'allow' or"),
        (
            "        signup: {schema: a.json}\n        again: {type: signup, schema: b.json}\n",
            "'signup' and 'again' are both the contract of type 'signup' for every source",
        ),
        (
            "        a: {type: '*', source: app, mode: warn}\n"
            "        b: {type: '*', source: app, mode: reject}\n",
            "'a' and 'b' are both the contract of type '*' for source 'app'",
        ),
        ("        signup: {schema: a.json, source: ''}\n", "an empty event type or source"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, contracts: str, says: str) -> None:
    with pytest.raises(InvalidConfig) as exc:
        load_config(config_file(tmp_path, contracts), env={})
    [issue] = exc.value.issues
    assert issue.key is not None and issue.key.startswith("pipeline.destinations[0].contracts")
    assert issue.line is not None
    assert says in issue.message


def test_schema_paths_resolve_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_schema(tmp_path, "signup/1-0-0.json", SIGNUP)
    path = config_file(
        tmp_path,
        "        signup: {schema: contracts/signup/1-0-0.json, mode: enforce}\n"
        '        "*": {mode: reject}\n',
    )
    monkeypatch.chdir(tmp_path.parent)
    [dest] = load_config(path, env={}).pipeline.destinations
    assert dest.contracts["signup"].schema_ == tmp_path / "contracts" / "signup" / "1-0-0.json"
    contracts = Contracts.compile(contracts_spec(dest.contracts))
    assert contracts.check("signup", GOOD).action == "pass"
    assert contracts.check("page", {}).action == "reject"


# -- the cache --------------------------------------------------------------------------------


def test_a_spec_is_compiled_once_per_process(tmp_path: Path) -> None:
    path = write_schema(tmp_path, "signup/1-0-0.json", SIGNUP)
    spec = contracts_spec({"signup": ContractConfig(schema=path)})
    first = Contracts.compile(spec)
    assert Contracts.compile(orjson.loads(orjson.dumps(spec))) is first  # equal data, same one
    changed = copy.deepcopy(spec)
    changed["unknown"] = "reject"
    other = Contracts.compile(changed)
    assert other is not first
    assert other.check("page", {}).action == "reject"
    assert first.check("page", {}).action == "pass"
