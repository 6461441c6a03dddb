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

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from headwater.pipeline.columns import EVENT, json_path, pointer_parts, with_event
from headwater.pipeline.config import MappingConfig

Path = tuple[str, ...]
KEPT = "_hw_kept"


def apply_mapping(df: DataFrame, mapping: MappingConfig) -> DataFrame:
    """``event`` with the rules applied (rows without an event pass through)."""
    if not mapping.fields and mapping.keep_unmapped:
        return df
    for rule in mapping.fields:
        event = F.col(EVENT)
        if rule.action == "move":
            src, dst = _path(rule.src), _path(rule.dst)
            value = F.variant_get(event, json_path(src), "variant")
            moved = F.variant_set(F.variant_delete(event, json_path(src)), json_path(dst), value)
            df = with_event(df, F.when(value.isNull(), event).otherwise(moved))
        elif rule.action == "remove":
            df = with_event(df, F.variant_delete(event, json_path(_path(rule.src))))
        elif rule.action == "constant":
            constant = F.parse_json(F.lit(json.dumps(rule.value)))
            df = with_event(df, F.variant_set(event, json_path(_path(rule.dst)), constant))
    if not mapping.keep_unmapped:
        df = _keep_only(df, kept_paths(mapping))
    return df


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
    """``event`` reduced to ``paths``, built up one field per projection."""
    df = df.withColumn(KEPT, F.parse_json(F.lit("{}")))
    for path in paths:
        kept = F.col(KEPT)
        value = F.variant_get(F.col(EVENT), json_path(path), "variant")
        df = df.withColumn(
            KEPT,
            F.when(value.isNull(), kept).otherwise(F.variant_set(kept, json_path(path), value)),
        )
    return with_event(df, F.col(KEPT)).drop(KEPT)


def _path(pointer: str | None) -> Path:
    assert pointer is not None  # the config model requires it for this action
    return pointer_parts(pointer)
