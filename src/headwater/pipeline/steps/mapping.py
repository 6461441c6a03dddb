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

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from headwater.pipeline.columns import EVENT, pointer_parts, with_event
from headwater.pipeline.config import MappingConfig
from headwater.pipeline.structs import drop_path, get_path, set_path, type_at

Path = tuple[str, ...]
MOVED = "_hw_moved"


def apply_mapping(df: DataFrame, mapping: MappingConfig) -> DataFrame:
    """``event`` with the rules applied (rows without an event pass through)."""
    if not mapping.fields and mapping.keep_unmapped:
        return df
    for rule in mapping.fields:
        struct = _struct(df)
        event = F.col(EVENT)
        if rule.action == "move":
            src, dst = _path(rule.src), _path(rule.dst)
            value = get_path(event, struct, src)
            if value is None:
                continue
            previous = get_path(event, struct, dst)
            if previous is not None and type_at(struct, dst) == type_at(struct, src):
                value = F.coalesce(value, previous)  # a null src leaves dst as it was
            # the value is taken aside before its field is dropped, then set where it goes
            df = df.withColumn(MOVED, value)
            df = with_event(df, drop_path(event, struct, src))
            df = with_event(df, set_path(F.col(EVENT), _struct(df), dst, F.col(MOVED)))
            df = df.drop(MOVED)
        elif rule.action == "remove":
            df = with_event(df, drop_path(event, struct, _path(rule.src)))
        elif rule.action == "constant":
            df = with_event(df, set_path(event, struct, _path(rule.dst), constant(rule.value)))
    if not mapping.keep_unmapped:
        df = _keep_only(df, kept_paths(mapping))
    return df


def constant(value: Any) -> Column:
    """A rule's JSON value as a Spark value: scalars as themselves, objects as structs, arrays
    as their JSON text."""
    if isinstance(value, dict):
        text = F.lit(json.dumps(value))
        return F.from_json(text, F.schema_of_json(text))
    if isinstance(value, list):
        return F.lit(json.dumps(value))
    return F.lit(value)


def _struct(df: DataFrame) -> StructType:
    struct = df.schema[EVENT].dataType
    assert isinstance(struct, StructType)
    return struct


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


def _keep_only(df: DataFrame, paths: list[Path]) -> DataFrame:
    """``event`` reduced to ``paths`` (paths no event has are left out)."""
    struct = _struct(df)
    tree: dict[str, Any] = {}
    for path in paths:
        if type_at(struct, path) is None:
            continue
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = path
    if not tree:
        return df.withColumn(EVENT, F.lit(None).cast("struct<`_hw_none`:string>"))
    return with_event(df, _build(F.col(EVENT), struct, tree))


def _build(event: Column, struct: StructType, tree: dict[str, Any]) -> Column:
    fields = []
    for name, node in tree.items():
        if isinstance(node, dict):
            fields.append(_build(event, struct, node).alias(name))
        else:
            value = get_path(event, struct, node)
            assert value is not None
            fields.append(value.alias(name))
    return F.struct(*fields)


def _path(pointer: str | None) -> Path:
    assert pointer is not None  # the config model requires it for this action
    return pointer_parts(pointer)


def _under(path: Path, prefix: Path) -> bool:
    return path[: len(prefix)] == prefix


def trace(mapping: MappingConfig, paths: list[Path]) -> dict[Path, Path]:
    """Where each of ``paths`` (fields of the events before mapping) ends up: final path ->
    original path, for the fields the rules keep."""
    now = {p: p for p in paths}  # current path -> original
    for rule in mapping.fields:
        if rule.action == "move":
            src, dst = _path(rule.src), _path(rule.dst)
            moving = {p: o for p, o in now.items() if _under(p, src)}
            if not moving:
                continue
            now = {p: o for p, o in now.items() if not _under(p, src) and not _under(p, dst)}
            now.update({(*dst, *p[len(src) :]): o for p, o in moving.items()})
        elif rule.action == "remove":
            now = {p: o for p, o in now.items() if not _under(p, _path(rule.src))}
        elif rule.action == "constant":
            now = {p: o for p, o in now.items() if not _under(p, _path(rule.dst))}
    if not mapping.keep_unmapped:
        kept = kept_paths(mapping)
        now = {p: o for p, o in now.items() if any(_under(p, k) for k in kept)}
    return now
