"""Step 5, mapping rules (seed 002, "Mapping step"), applied to ``event`` in order:

- ``move``: the subtree at ``src`` goes to ``dst`` (replacing what was there); ``type``, when
  given, is the SQL type of the column(s) it becomes;
- ``remove``: the subtree at ``src`` goes;
- ``cast``: the column(s) of ``src`` get the explicit SQL type ``type``;
- ``constant``: ``value`` is set at ``dst``.

With ``keep_unmapped: false`` only the fields the rules name (``dst`` of move and constant,
``src`` of cast) are kept. The explicit types come back separately (``explicit_types``): they
are not part of the data but of the table.
"""

from __future__ import annotations

import json
from typing import Any

from headwater.pipeline import sql
from headwater.pipeline.columns import pointer_parts
from headwater.pipeline.config import MappingConfig
from headwater.pipeline.fields import (
    BIGINT,
    BOOLEAN,
    DOUBLE,
    RAW,
    TEXT,
    Field,
    Fields,
    any_present,
    set_subtree,
    subtree,
    under,
)
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, JSON, STRING

Path = tuple[str, ...]


def apply(fields: Fields, mapping: MappingConfig) -> Fields:
    """``fields`` with the rules applied, in order."""
    for rule in mapping.fields:
        if rule.action == "move":
            src, dst = _path(rule.src), _path(rule.dst)
            moving = subtree(fields, src)
            if not moving:
                continue
            # where the source has a value, it replaces the destination; elsewhere the
            # destination stays as it was
            present = any_present(moving)
            rest = {p: f for p, f in fields.items() if not under(p, src)}
            fields = set_subtree(rest, dst, moving, present)
        elif rule.action == "remove":
            src = _path(rule.src)
            fields = {p: f for p, f in fields.items() if not under(p, src)}
        elif rule.action == "constant":
            dst = _path(rule.dst)
            fields = set_subtree(fields, dst, constant(rule.value, dst), None)
    if not mapping.keep_unmapped:
        kept = kept_paths(mapping)
        fields = {p: f for p, f in fields.items() if any(under(p, k) for k in kept)}
    return fields


def constant(value: Any, at: Path) -> Fields:
    """A rule's JSON value as fields keyed by their path below ``at``: objects opened, arrays
    kept whole as JSON text, null as nothing."""
    if isinstance(value, dict) and value:
        out: Fields = {}
        for key, inner in value.items():
            for rest, f in constant(inner, (*at, key)).items():
                out[(key, *rest)] = f
        return out
    if value is None:
        return {}
    if isinstance(value, dict | list):
        text = sql.lit(json.dumps(value))
        return {(): Field(at, text, RAW, frozenset({JSON}))}
    if isinstance(value, bool):
        return {(): Field(at, sql.lit(value), BOOLEAN, frozenset({BOOL}))}
    if isinstance(value, int):
        return {(): Field(at, sql.lit(value), BIGINT, frozenset({INT64}))}
    if isinstance(value, float):
        return {(): Field(at, sql.lit(value), DOUBLE, frozenset({FLOAT64}))}
    return {(): Field(at, sql.lit(str(value)), TEXT, frozenset({STRING}))}


def kept_paths(mapping: MappingConfig) -> list[Path]:
    """The fields the rules name, which ``keep_unmapped: false`` keeps."""
    out: list[Path] = []
    for rule in mapping.fields:
        if rule.action in ("move", "constant"):
            out.append(_path(rule.dst))
        elif rule.action == "cast":
            out.append(_path(rule.src))
    return out


def explicit_types(mapping: MappingConfig) -> dict[Path, str]:
    """Path -> SQL type, from ``cast`` rules and ``move`` rules with a type (later rules win)."""
    out: dict[Path, str] = {}
    for rule in mapping.fields:
        if rule.type is None:
            continue
        if rule.action == "cast":
            out[_path(rule.src)] = rule.type
        elif rule.action == "move":
            out[_path(rule.dst)] = rule.type
    return out


def _path(pointer: str | None) -> Path:
    assert pointer is not None  # the config model requires it for this action
    return pointer_parts(pointer)


def trace(mapping: MappingConfig, paths: list[Path]) -> dict[Path, Path]:
    """Where each of ``paths`` (fields of the events before mapping) ends up: final path ->
    original path, for the fields the rules keep."""
    now = {p: p for p in paths}  # current path -> original
    for rule in mapping.fields:
        if rule.action == "move":
            src, dst = _path(rule.src), _path(rule.dst)
            moving = {p: o for p, o in now.items() if under(p, src)}
            if not moving:
                continue
            now = {p: o for p, o in now.items() if not under(p, src) and not under(p, dst)}
            now.update({(*dst, *p[len(src) :]): o for p, o in moving.items()})
        elif rule.action == "remove":
            now = {p: o for p, o in now.items() if not under(p, _path(rule.src))}
        elif rule.action == "constant":
            now = {p: o for p, o in now.items() if not under(p, _path(rule.dst))}
    if not mapping.keep_unmapped:
        kept = kept_paths(mapping)
        now = {p: o for p, o in now.items() if any(under(p, k) for k in kept)}
    return now
