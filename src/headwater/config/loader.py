"""Load ``headwater.yaml``: read it, apply ``HEADWATER_`` env overrides, validate, resolve paths.

Errors name every bad key as a dotted path (``bus.embedded.durability``) with the file, line and
column it came from (found by composing the YAML with PyYAML and following pydantic's error
locations through the node tree), or the env variable that set it.

Rules:

- ``load_config(path)`` reads ``path``; without it, ``./headwater.yaml`` if present, else the
  embedded defaults.
- ``HEADWATER_<KEY>[__<KEY>...]=value`` sets ``key.key...`` (``__`` separates levels, names are
  case-insensitive): ``HEADWATER_BUS__EMBEDDED__DURABILITY=never``. A value is read as a YAML
  scalar (``true``, ``100``, ``null``), except for text and path settings, which take it as given.
  A variable naming a section (``HEADWATER_BUS__KAFKA__CLIENT='{security.protocol: SSL}'``)
  replaces that section. ``HEADWATER_CONFIG`` is not a setting: the command line reads it as the
  config file's path.
- Relative paths from the file, and defaults when there is a file, resolve against the file's
  directory; those from the environment, or defaults without a file, against the working
  directory.

Loading does no I/O besides reading the file.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("headwater.yaml")
ENV_PREFIX = "HEADWATER_"
ENV_SEPARATOR = "__"
# The one variable with the prefix that is not a setting: the command line's config file. Tools
# that are not settings (test service binaries, the bootstrap's Python) use the HW_ prefix.
ENV_RESERVED = frozenset({"HEADWATER_CONFIG"})

KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration: which key, why, and where it came from."""

    key: str | None
    message: str
    file: str | None = None
    line: int | None = None
    column: int | None = None
    env: str | None = None

    def location(self) -> str:
        """``file:line:column``, ``env VAR`` or just ``file``; empty when nothing is known."""
        if self.env is not None:
            return f"env {self.env}"
        if self.file is None:
            return ""
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return where

    def __str__(self) -> str:
        parts = [p for p in (self.location(), self.key) if p]
        return ": ".join([*parts, self.message])

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "message": self.message,
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "env": self.env,
        }


class InvalidConfig(ConfigError):
    """The configuration is invalid; ``issues`` lists every problem found."""

    def __init__(self, issues: Sequence[ConfigIssue], file: Path | None = None) -> None:
        self.issues = tuple(issues)
        self.file = file
        if len(self.issues) == 1:
            message = str(self.issues[0])
        else:
            source = f" in {file}" if file is not None else ""
            lines = "\n".join(f"  {issue}" for issue in self.issues)
            message = f"{len(self.issues)} problems in the configuration{source}:\n{lines}"
        super().__init__(message)


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and where it came from."""

    config: HeadwaterConfig
    file: Path | None
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    """Each env variable applied, by the dotted key it set."""


def find_config_file(path: Path | str | None = None) -> Path | None:
    """The file ``load_config`` reads: ``path`` if given, else ``./headwater.yaml`` if it exists."""
    if path is not None:
        return Path(path)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_config(
    path: Path | str | None = None, env: Mapping[str, str] | None = None
) -> HeadwaterConfig:
    """Read, override from ``env`` (default: ``os.environ``) and validate the configuration.

    Raises ``InvalidConfig`` (a ``ConfigError``) naming every bad key, its file and line.
    """
    return read_config(path, env).config


def read_config(
    path: Path | str | None = None, env: Mapping[str, str] | None = None
) -> LoadedConfig:
    """``load_config`` that also says which file and which env variables were used."""
    file = find_config_file(path)
    display = str(file) if file is not None else None
    issues: list[ConfigIssue] = []

    data: dict[str, Any] = {}
    root: yaml.Node | None = None
    if file is not None:
        data, root = _read_yaml(file, display or "")

    env_paths = _apply_env(data, os.environ if env is None else env, issues)
    if file is not None:  # Python functions may be modules beside the config
        folder = str(file.parent.absolute())
        if folder not in sys.path:
            sys.path.append(folder)

    config: HeadwaterConfig | None = None
    try:
        config = HeadwaterConfig.model_validate(data)
    except ValidationError as exc:
        issues.extend(_issues_from_validation(exc, root, display, env_paths))
    if issues or config is None:
        raise InvalidConfig(sorted(issues, key=_issue_order), file)

    cwd = Path.cwd()
    file_base = file.parent.absolute() if file is not None else cwd
    config = _resolve_paths(config, (), file_base, cwd, env_paths)
    return LoadedConfig(
        config=config,
        file=file,
        env_overrides={_dotted(p): var for p, var in sorted(env_paths.items())},
    )


def _issue_order(issue: ConfigIssue) -> tuple[bool, int, int, str]:
    """File issues by position, then those from the environment."""
    return (issue.env is not None, issue.line or 0, issue.column or 0, issue.env or "")


# -- the file ---------------------------------------------------------------------------------


def _read_yaml(file: Path, display: str) -> tuple[dict[str, Any], yaml.Node | None]:
    try:
        text = file.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InvalidConfig(
            [ConfigIssue(None, "config file not found", file=display)], file
        ) from None
    except IsADirectoryError:
        raise InvalidConfig(
            [ConfigIssue(None, "is a directory, not a config file", file=display)], file
        ) from None
    except UnicodeDecodeError as exc:
        raise InvalidConfig(
            [ConfigIssue(None, f"is not UTF-8 text (byte {exc.start})", file=display)], file
        ) from None
    except OSError as exc:
        raise InvalidConfig(
            [ConfigIssue(None, f"cannot be read: {exc.strerror}", file=display)], file
        ) from None

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        duplicates = list(_duplicate_keys(root, (), display)) if root is not None else []
        if duplicates:
            raise InvalidConfig(duplicates, file)
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        raise InvalidConfig([_yaml_issue(exc, display)], file) from None
    except yaml.YAMLError as exc:
        raise InvalidConfig(
            [ConfigIssue(None, f"invalid YAML: {exc}", file=display)], file
        ) from None
    finally:
        loader.dispose()

    if data is None:  # an empty file (or only comments): the defaults
        return {}, None
    if not isinstance(data, dict):
        assert root is not None
        raise InvalidConfig(
            [
                ConfigIssue(
                    None,
                    f"the top level must be a mapping of settings (key: value), "
                    f"not {_yaml_kind(data)}",
                    file=display,
                    line=root.start_mark.line + 1,
                    column=root.start_mark.column + 1,
                )
            ],
            file,
        )
    return data, root


def _yaml_issue(exc: yaml.MarkedYAMLError, display: str) -> ConfigIssue:
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "syntax error"
    message = f"invalid YAML: {problem}"
    if exc.problem and exc.context:
        context = exc.context
        if exc.context_mark is not None and exc.context_mark is not mark:
            context += f" at line {exc.context_mark.line + 1}"
        if problem.startswith("but "):
            message = f"invalid YAML: {context}, {problem}"
        else:
            message += f" ({context})"
    return ConfigIssue(
        None,
        message,
        file=display,
        line=mark.line + 1 if mark is not None else None,
        column=mark.column + 1 if mark is not None else None,
    )


def _duplicate_keys(node: yaml.Node, path: KeyPath, display: str) -> Iterator[ConfigIssue]:
    """YAML forbids repeated keys, but PyYAML keeps the last silently: name them instead."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = str(key_node.value)
                first = seen.get(name)
                if first is not None:
                    yield ConfigIssue(
                        _dotted((*path, name)),
                        f"duplicate key (first set at line {first.start_mark.line + 1})",
                        file=display,
                        line=key_node.start_mark.line + 1,
                        column=key_node.start_mark.column + 1,
                    )
                else:
                    seen[name] = key_node
                yield from _duplicate_keys(value_node, (*path, name), display)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*path, str(i)), display)


def _yaml_kind(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return f"a {type(value).__name__}"


# -- env overrides ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """A place in the config model: a section (model), a choice of sections (union), a
    mapping or list of values, or one setting (leaf)."""

    kind: Literal["model", "union", "mapping", "sequence", "leaf"]
    annotation: Any
    """The model; the member models (union); the value type (mapping, sequence); the type."""


def _classify(annotation: Any) -> _Target:
    kinds = [arg for arg in _union_args(annotation) if arg is not type(None)]
    models = tuple(arg for arg in kinds if isinstance(arg, type) and issubclass(arg, BaseModel))
    if len(models) == 1:
        return _Target("model", models[0])
    if models:
        return _Target("union", models)
    if len(kinds) == 1:
        origin = get_origin(kinds[0])
        args = get_args(kinds[0])
        if origin in (dict, Mapping):
            return _Target("mapping", args[1] if len(args) == 2 else Any)
        if origin in (list, tuple, set, frozenset, Sequence):
            return _Target("sequence", args[0] if args else Any)
    return _Target("leaf", annotation)


def _child(target: _Target, part: str) -> _Target | None:
    """The place ``part`` names inside ``target``, or None if it names nothing there."""
    if target.kind == "model":
        info = target.annotation.model_fields.get(part)
        return _classify(info.annotation) if info is not None else None
    if target.kind == "union":
        for model in target.annotation:
            info = model.model_fields.get(part)
            if info is not None:
                return _classify(info.annotation)
        return None
    if target.kind == "mapping":
        return _classify(target.annotation)
    if target.kind == "sequence" and part.isdigit():
        return _classify(target.annotation)
    return None


def _root(model: type[BaseModel] = HeadwaterConfig) -> _Target:
    return _Target("model", model)


def _apply_env(
    data: dict[str, Any], env: Mapping[str, str], issues: list[ConfigIssue]
) -> dict[KeyPath, str]:
    """Set each ``HEADWATER_*`` variable into ``data``; return the key paths set, by variable."""
    resolved: list[tuple[KeyPath, str, str, _Target]] = []
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_RESERVED:
            continue
        parts = tuple(var[len(ENV_PREFIX) :].lower().split(ENV_SEPARATOR))
        target, problem = _env_target(parts)
        if target is None:
            issues.append(ConfigIssue(_dotted(parts), problem, env=var))
            continue
        resolved.append((parts, var, raw, target))

    applied: dict[KeyPath, str] = {}
    # Whole sections first, so that a more specific variable refines them.
    for parts, var, raw, target in sorted(resolved, key=lambda r: (len(r[0]), r[1])):
        parent = data
        for part in parts[:-1]:
            child = parent.get(part)
            if not isinstance(child, dict):
                child = {}
                parent[part] = child
            parent = child
        parent[parts[-1]] = _env_value(raw, target)
        applied[parts] = var
    return applied


def _env_target(parts: KeyPath) -> tuple[_Target | None, str]:
    """Follow ``parts`` through the config model; ``(None, why)`` if they name no setting."""
    target = _root()
    for depth, part in enumerate(parts):
        if not part:
            return None, f"empty level in the variable name (use {ENV_SEPARATOR!r} between levels)"
        child = _child(target, part)
        if child is None:
            parent = parts[:depth]
            if target.kind == "model":
                return None, _unknown_key_message(
                    part, list(target.annotation.model_fields), parent
                )
            if target.kind == "union":
                return None, _unknown_key_message(part, _fields_at(parent), parent)
            if target.kind == "sequence":
                return None, f"{_dotted(parent)} is a list: set it whole, as a YAML list"
            return None, f"{_dotted(parent)} is a single setting; it has no key {part!r}"
        target = child
    return target, ""


def _env_value(raw: str, target: _Target) -> Any:
    if target.kind == "leaf":
        if raw.strip() in ("", "~", "null", "Null", "NULL") and _allows_none(target.annotation):
            return None
        if _is_textlike(target.annotation):
            return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _union_args(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | Y``, ``Optional[X]``), or just the type; ``Annotated``
    metadata is dropped."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(_union_args(arg)[0] for arg in get_args(annotation))
    return (annotation,)


def _allows_none(annotation: Any) -> bool:
    return any(arg is type(None) for arg in _union_args(annotation))


def _is_textlike(annotation: Any) -> bool:
    """Text, paths and choices of words take an env value as given (``on`` stays ``on``)."""
    kinds = [arg for arg in _union_args(annotation) if arg is not type(None)]
    if not kinds:
        return False
    for arg in kinds:
        if arg in (str, Path):
            continue
        if get_origin(arg) is Literal and all(isinstance(v, str) for v in get_args(arg)):
            continue
        return False
    return True


def _has_path(annotation: Any) -> bool:
    return any(arg is Path for arg in _union_args(annotation))


# -- validation errors ------------------------------------------------------------------------


def _issues_from_validation(
    exc: ValidationError,
    root: yaml.Node | None,
    display: str | None,
    env_paths: Mapping[KeyPath, str],
    model: type[BaseModel] = HeadwaterConfig,
) -> list[ConfigIssue]:
    """One issue per bad key of the input ``model`` was validated from."""
    schema = _root(model)
    grouped: dict[KeyPath, list[ErrorDetails]] = {}
    for error in exc.errors(include_url=False):
        key = _error_key(error, schema)
        grouped.setdefault(key, []).append(error)

    issues: list[ConfigIssue] = []
    for key, errors in grouped.items():
        kind = errors[0]["type"]
        message = _error_message(key, errors, schema)
        env_var = _env_origin(key, env_paths)
        if env_var is not None:
            issues.append(ConfigIssue(_dotted(key), message, env=env_var))
            continue
        line = column = None
        mark = _node_mark(root, key, want_key=kind == "extra_forbidden")
        if mark is not None:
            line, column = mark.line + 1, mark.column + 1
        issues.append(ConfigIssue(_dotted(key), message, file=display, line=line, column=column))
    return issues


def _error_key(error: ErrorDetails, root: _Target | None = None) -> KeyPath:
    """The keys of the input that pydantic's ``loc`` goes through, without the union member
    tags in it (``PostgresConfig`` or a discriminator value between keys; ``str``, ``int``,
    ``function-after[...]`` after a setting)."""
    loc = tuple(str(p) for p in error["loc"])
    last_is_key = error["type"] in ("extra_forbidden", "missing")
    target = root or _root()
    keys: list[str] = []
    for i, part in enumerate(loc):
        child = _child(target, part)
        if child is not None:
            keys.append(part)
            target = child
        elif last_is_key and i == len(loc) - 1:
            keys.append(part)  # the unknown (or missing) key itself
        elif target.kind == "union":
            continue  # the tag of the member pydantic tried
        else:
            break  # tags after a setting, or keys below one
    return tuple(keys)


def _error_message(key: KeyPath, errors: list[ErrorDetails], schema: _Target) -> str:
    first = errors[0]
    if first["type"] == "extra_forbidden":
        return _unknown_key_message(key[-1], _fields_at(key[:-1], schema), key[:-1])
    if first["type"] == "missing":
        return "required setting is missing"
    messages: list[str] = []
    for error in errors:
        msg = error["msg"]
        if msg not in messages:
            messages.append(msg)
    prefix = "Input should be "
    if len(messages) > 1 and all(m.startswith(prefix) for m in messages):
        tails = [m[len(prefix) :] for m in messages]
        text = prefix + ", ".join(tails[:-1]) + " or " + tails[-1]
    else:
        text = "; or ".join(messages)
    return f"{text} (got {_short_repr(first.get('input'))})"


def _unknown_key_message(name: str, fields: Sequence[str], parent: KeyPath) -> str:
    if not fields:
        return f"unknown key {name!r}"
    where = f" in {_dotted(parent)}" if parent else ""
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f"unknown key {name!r}{where}; did you mean {close[0]!r}?"
    return f"unknown key {name!r}{where}; expected one of: {', '.join(fields)}"


def _fields_at(path: KeyPath, root: _Target | None = None) -> list[str]:
    """The keys the section at ``path`` takes (of every member, for a choice of sections)."""
    target: _Target | None = root or _root()
    for part in path:
        target = _child(target, part) if target is not None else None
    if target is None:
        return []
    if target.kind == "model":
        return list(target.annotation.model_fields)
    if target.kind == "union":
        return list(dict.fromkeys(f for m in target.annotation for f in m.model_fields))
    return []


def _env_origin(key: KeyPath, env_paths: Mapping[KeyPath, str]) -> str | None:
    best: tuple[int, str] | None = None
    for path, var in env_paths.items():
        if key[: len(path)] == path and (best is None or len(path) > best[0]):
            best = (len(path), var)
    return best[1] if best else None


def _node_mark(root: yaml.Node | None, key: KeyPath, *, want_key: bool) -> yaml.Mark | None:
    """The position in the file of ``key`` (its key's position if ``want_key``), or of the
    closest enclosing node found."""
    if root is None:
        return None
    node: yaml.Node = root
    mark: yaml.Mark = root.start_mark
    for depth, part in enumerate(key):
        last = depth == len(key) - 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in reversed(node.value):  # the last duplicate wins
                if isinstance(key_node, yaml.ScalarNode) and str(key_node.value) == part:
                    mark = key_node.start_mark if (last and want_key) else value_node.start_mark
                    node = value_node
                    break
            else:
                return mark
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            mark = node.start_mark
        else:
            return mark
    return mark


def _dotted(path: Sequence[str]) -> str:
    out = ""
    for part in path:
        if part.isidentifier():
            out += f".{part}" if out else part
        elif part.isdigit():
            out += f"[{part}]"
        else:
            out += f"[{part!r}]"
    return out


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- paths ------------------------------------------------------------------------------------


def _resolve_paths(
    model: BaseModel,
    path: KeyPath,
    file_base: Path,
    cwd: Path,
    env_paths: Mapping[KeyPath, str],
) -> Any:
    updates: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        here = (*path, name)
        if isinstance(value, BaseModel):
            resolved = _resolve_paths(value, here, file_base, cwd, env_paths)
            if resolved is not value:
                updates[name] = resolved
        elif isinstance(value, dict | list):  # sections by name or in a list
            each = _resolve_each(value, here, file_base, cwd, env_paths)
            if each is not value:
                updates[name] = each
        elif isinstance(value, Path) and _has_path(info.annotation):
            base = cwd if _env_origin(here, env_paths) is not None else file_base
            absolute = _absolute(value, base)
            if absolute != value:
                updates[name] = absolute
    return model.model_copy(update=updates) if updates else model


def _resolve_each(
    values: dict[Any, Any] | list[Any],
    path: KeyPath,
    file_base: Path,
    cwd: Path,
    env_paths: Mapping[KeyPath, str],
) -> dict[Any, Any] | list[Any]:
    """``_resolve_paths`` over the sections of a mapping or a list; ``values`` if none changed."""
    pairs = list(values.items() if isinstance(values, dict) else enumerate(values))
    done = [
        (k, _resolve_paths(v, (*path, str(k)), file_base, cwd, env_paths))
        if isinstance(v, BaseModel)
        else (k, v)
        for k, v in pairs
    ]
    if all(new is old for (_, new), (_, old) in zip(done, pairs, strict=True)):
        return values
    return dict(done) if isinstance(values, dict) else [v for _, v in done]


def _absolute(value: Path, base: Path) -> Path:
    expanded = value.expanduser()
    if expanded.is_absolute():
        return expanded
    return Path(os.path.normpath(base / expanded))
