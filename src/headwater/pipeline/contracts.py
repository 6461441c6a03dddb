"""Data contracts: a JSON Schema (draft 2020-12) per event type that a destination's events meet.

A destination's ``contracts:`` maps event types to a schema file and a mode:

- a named type takes ``enforce`` (a violating event is rejected: it goes to the failed store
  with every violation) or ``warn`` (it lands, its violations in a ``_hw_violations`` field);
- ``"*"``, the types with no contract, takes ``allow`` (the default when there is no ``"*"``),
  ``warn`` (they land with a violation saying there is no contract) or ``reject``.

A contract may be for one source only (``source: mobile``; the record's source header), with
its type named by ``type:`` when the key is taken (``mobile_signup: {type: signup, source:
mobile, ...}``). An event's own source's contract for its type comes first, then the one for
every source; with neither, the source's ``"*"``, then the one for every source.

Schemas are versioned by file name: ``contracts/signup/1-0-0.json`` is the contract
``signup/1-0-0`` (its folder and its name). A ``$ref`` to another file resolves against the
schema's own file (``{"$ref": "address.json"}`` reads ``address.json`` beside it); remote
references are not fetched. ``format`` is asserted (``email``, ``date-time``, ``uri``...), as
Iglu and Segment Protocols do, although draft 2020-12 makes it an annotation by default.

Which event type an event has (``event_type_of``): its ``event`` field when that is text
(Segment's and Jitsu's track names), else its ``event_type`` field when text, else the record's
type header (Raccoon's event type, or the Segment call: ``page``, ``identify``...).

The driver reads the files once (``contracts_spec``: plain JSON with the schemas inline, which
travels inside the program, so workers read no files); each worker compiles a spec once
(``Contracts.compile``, cached by the spec's hash) and judges events with ``Contracts.check``.

The validator is ``jsonschema-rs`` (Rust). ``bench/contracts.py`` measured it against
``fastjsonschema`` (generated Python) and the reference ``jsonschema`` on 200,000 Segment-style
track events (2 shared cores): valid events 315,000/s (465,000 in a quieter run) against
fastjsonschema's 40,000-54,000/s and jsonschema's 3,800/s; violating events, every violation
reported, 50,600/s against fastjsonschema's 35,600/s (``fast_fail=False``; 103,000/s when it
stops at the first) and jsonschema's 3,200/s. It also implements draft 2020-12, which
fastjsonschema does not (drafts 4, 6 and 7 only).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlparse

import orjson
from pydantic import AfterValidator, ConfigDict, Field, model_validator

from headwater.config.base import Section
from headwater.errors import ConfigError

UNKNOWN = "*"  # the key of the types with no contract
NAMED_MODES = ("enforce", "warn")
UNKNOWN_MODES = ("allow", "warn", "reject")
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
Action = Literal["pass", "warn", "reject"]


class ContractConfig(Section):
    """One entry of a destination's ``contracts:``: a schema file and a mode."""

    model_config = ConfigDict(**Section.model_config, populate_by_name=True)  # schema_ in JSON

    schema_: Path | None = Field(
        None, alias="schema", description="A JSON Schema (draft 2020-12) file, beside the config."
    )
    mode: Literal["enforce", "warn", "allow", "reject"] = Field(
        "enforce",
        description='What a violation does: enforce or warn; for "*" (types with no contract): '
        "allow, warn or reject (docs/shaping.md).",
    )
    type: str | None = Field(
        None, description='The event type it is for (default: its key; "*": types with none).'
    )
    source: str | None = Field(
        None,
        description="Only for events from this source (the record's source header: the "
        "collector's source id); default: every source. A source's contract comes first.",
    )

    @model_validator(mode="after")
    def _schema_fits_mode(self) -> ContractConfig:
        if self.mode in ("allow", "reject") and self.schema_ is not None:
            raise ValueError(
                f'mode {self.mode!r} is for "*" (types with no contract) and takes no schema'
            )
        return self


def _check_contracts(contracts: dict[str, ContractConfig]) -> dict[str, ContractConfig]:
    taken: dict[tuple[str | None, str], str] = {}  # (source, type) -> key
    for key, contract in contracts.items():
        kind = contract.type if contract.type is not None else key
        if not kind or contract.source == "":
            raise ValueError(
                f'{key!r}: an empty event type or source: name it, or use "*" for all others'
            )
        where = (contract.source, kind)
        if where in taken:
            whose = f"source {contract.source!r}" if contract.source else "every source"
            raise ValueError(
                f"{taken[where]!r} and {key!r} are both the contract of type {kind!r} for {whose}"
            )
        taken[where] = key
        if kind == UNKNOWN:
            if contract.schema_ is not None:
                raise ValueError(f'{key!r}: "*" (types with no contract) takes no schema')
            if contract.mode not in UNKNOWN_MODES:
                raise ValueError(
                    f'{key!r}: "*" (types with no contract) takes mode allow, warn or reject, '
                    f"not {contract.mode!r}"
                )
        elif contract.mode not in NAMED_MODES:
            raise ValueError(
                f"{key!r}: a contract takes mode enforce or warn, not {contract.mode!r} "
                '(allow and reject are for "*")'
            )
        elif contract.schema_ is None:
            raise ValueError(f"{key!r}: mode {contract.mode!r} needs schema (a JSON Schema file)")
    return contracts


# A destination's ``contracts:``: event type -> contract, checked as a whole.
ContractMap = Annotated[dict[str, ContractConfig], AfterValidator(_check_contracts)]


class ContractConfigError(ConfigError):
    """A contract's schema file is missing, is not JSON, or is not a valid 2020-12 schema."""

    code = "HW-PIPE-502"


@dataclass(frozen=True, slots=True)
class Violation:
    """One way an event breaks its contract."""

    path: str  # JSON pointer into the event ("/properties/plan"; "" is the whole event)
    keyword: str  # the schema keyword that failed (required, type, enum, format...)
    message: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "keyword": self.keyword, "message": self.message}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a contract says of one event: pass, warn (it lands, flagged) or reject."""

    action: Action
    contract: str | None  # the contract's label (signup/1-0-0); None: the type has none
    violations: tuple[Violation, ...] = ()


def violations_json(verdict: Verdict) -> list[dict[str, str]]:
    """The ``_hw_violations`` field's value: a list of ``{path, keyword, message}``."""
    return [v.to_json() for v in verdict.violations]


def reason(verdict: Verdict) -> str:
    """One line for the failed store:
    ``contract signup/1-0-0: /properties/plan: "gold" is not one of ... (enum); ...``."""
    if verdict.contract is None:
        return "; ".join(v.message for v in verdict.violations)
    found = "; ".join(f"{v.path or '/'}: {v.message} ({v.keyword})" for v in verdict.violations)
    return f"contract {verdict.contract}: {found}"


def event_type_of(event: Mapping[str, Any], type_header: str | None) -> str | None:
    """The type an event's contract is chosen by: its ``event`` field when text (a Segment or
    Jitsu track name), else its ``event_type`` field when text, else the record's type header
    (Raccoon's type, Segment's call type: page, identify...); None when there is none."""
    for name in ("event", "event_type"):
        value = event.get(name)
        if isinstance(value, str) and value:
            return value
    return type_header or None


def contract_label(schema: Path) -> str:
    """``contracts/signup/1-0-0.json`` -> ``signup/1-0-0``: the schema's folder and name."""
    return f"{schema.parent.name}/{schema.stem}" if schema.parent.name else schema.stem


# -- the driver: files -> spec ------------------------------------------------------------------


def contracts_spec(config: Mapping[str, ContractConfig], key: str = "contracts") -> dict[str, Any]:
    """Read and check every contract's schema (driver side) into plain JSON data: each schema
    inline with the files it references, so the workers read no files. ``key`` prefixes the
    errors' key (``pipeline.destinations[0].contracts``). The spec: ``contracts`` (type ->
    contract, for every source), ``unknown`` (the mode of types with none), and per source
    (``sources``: source -> the same two)."""
    spec: dict[str, Any] = {"contracts": {}, "unknown": "allow", "sources": {}}
    for name, contract in config.items():
        kind = contract.type if contract.type is not None else name
        scope = spec
        if contract.source is not None:
            scope = spec["sources"].setdefault(contract.source, {"contracts": {}})
        if kind == UNKNOWN:
            scope["unknown"] = contract.mode
            continue
        assert contract.schema_ is not None  # ContractMap's check
        where = f"{key}.{name}" if name.isidentifier() else f"{key}[{name!r}]"
        schema, base_uri = _load_schema(contract.schema_, f"{where}.schema")
        scope["contracts"][kind] = {
            "label": contract_label(contract.schema_),
            "mode": contract.mode,
            "schema": schema,
            "base_uri": base_uri,
        }
    return spec


def _load_schema(path: Path, where: str) -> tuple[Any, str]:
    """The schema in ``path`` with the files it references bundled in, and its base URI."""
    import jsonschema_rs

    def fail(why: str) -> ContractConfigError:
        return ContractConfigError(f"{where}: {path}: {why}")

    try:
        schema = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise fail(f"cannot read it: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise fail(f"is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise fail("is not a JSON Schema (an object)")
    declared = schema.get("$schema", DRAFT_2020_12) if isinstance(schema, dict) else DRAFT_2020_12
    if str(declared).rstrip("#") != DRAFT_2020_12:
        raise fail(f"declares $schema {declared!r}; contracts are draft 2020-12 ({DRAFT_2020_12})")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        at = _pointer(exc.instance_path) or "/"
        raise fail(f"is not a valid draft 2020-12 schema: at {at}: {exc.message}") from None
    base_uri = path.absolute().as_uri()
    try:
        bundled = jsonschema_rs.bundle(schema, retriever=_read_file, base_uri=base_uri)
        _validator(bundled, base_uri)
    except Exception as exc:  # the library raises assorted types for references and patterns
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise fail(f"cannot be compiled: {first}") from None
    return bundled, base_uri


def _read_file(uri: str) -> Any:
    """What a ``$ref`` to another file names; remote references are not fetched."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(f"{uri} is not a local file: contracts do not fetch remote schemas")
    return orjson.loads(Path(unquote(parsed.path)).read_bytes())


def _validator(schema: Any, base_uri: str) -> Any:
    import jsonschema_rs

    return jsonschema_rs.Draft202012Validator(
        schema, validate_formats=True, base_uri=base_uri, offline=True
    )


# -- the workers: spec -> verdicts --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Contract:
    label: str
    enforce: bool
    validator: Any
    passed: Verdict


class Contracts:
    """A compiled spec: ``check`` judges an event by its type's contract."""

    def __init__(
        self,
        contracts: Mapping[str, _Contract],
        unknown: str,
        sources: Mapping[str, Contracts] | None = None,
    ) -> None:
        self._contracts = dict(contracts)
        self._unknown = unknown
        self._sources = dict(sources or {})
        self._allowed = Verdict("pass", None)

    @classmethod
    def compile(cls, spec: Mapping[str, Any]) -> Contracts:
        """The compiled ``spec`` (``contracts_spec``'s data), once per process per spec."""
        digest = hashlib.sha256(orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)).hexdigest()
        found = _COMPILED.get(digest)
        if found is None:
            found = cls._build(spec)
            _COMPILED[digest] = found
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        else:
            _COMPILED.move_to_end(digest)
        return found

    @classmethod
    def _build(cls, spec: Mapping[str, Any], unknown: str = "allow") -> Contracts:
        compiled = {}
        for event_type, c in spec.get("contracts", {}).items():
            label = c["label"]
            compiled[event_type] = _Contract(
                label=label,
                enforce=c["mode"] == "enforce",
                validator=_validator(c["schema"], c["base_uri"]),
                passed=Verdict("pass", label),
            )
        unknown = spec.get("unknown", unknown)
        sources = {s: cls._build(sub, unknown) for s, sub in spec.get("sources", {}).items()}
        return cls(compiled, unknown, sources)

    @property
    def by_source(self) -> bool:
        """Some contracts are for one source only (``check`` needs the event's)."""
        return bool(self._sources)

    def check(self, event_type: str | None, event: Any, source: str | None = None) -> Verdict:
        """The verdict on ``event`` by the contract of ``event_type``: its ``source``'s, else
        the one for every source; else by ``"*"`` (the source's, else the one for all)."""
        scoped = self._sources.get(source) if source is not None else None
        contract = None
        if event_type is not None:
            if scoped is not None:
                contract = scoped._contracts.get(event_type)
            if contract is None:
                contract = self._contracts.get(event_type)
        if contract is None:
            return (scoped or self)._no_contract(event_type)
        validator = contract.validator
        if validator.is_valid(event):
            return contract.passed
        found = tuple(
            Violation(_pointer(e.instance_path), e.kind.name, e.message)
            for e in validator.iter_errors(event)
        )
        return Verdict("reject" if contract.enforce else "warn", contract.label, found)

    def check_many(self, types: Sequence[str | None], texts: Sequence[str]) -> list[Verdict]:
        """``check`` over a batch of events given as JSON text; a text that is not JSON is
        rejected."""
        verdicts = []
        check = self.check
        loads = orjson.loads
        for event_type, text in zip(types, texts, strict=True):
            try:
                event = loads(text)
            except orjson.JSONDecodeError as exc:
                verdicts.append(
                    Verdict("reject", None, (Violation("", "json", f"not JSON: {exc}"),))
                )
                continue
            verdicts.append(check(event_type, event))
        return verdicts

    def _no_contract(self, event_type: str | None) -> Verdict:
        if self._unknown == "allow":
            return self._allowed
        what = f"event type {event_type!r}" if event_type is not None else "events with no type"
        why = Violation("", "contract", f'no contract for {what} ("*" is {self._unknown})')
        return Verdict("warn" if self._unknown == "warn" else "reject", None, (why,))


_COMPILED: OrderedDict[str, Contracts] = OrderedDict()
_COMPILED_MAX = 16


def _pointer(parts: Sequence[str | int]) -> str:
    """A JSON pointer (RFC 6901) of a path's parts: ``["items", 2, "a/b"]`` -> ``/items/2/a~1b``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
