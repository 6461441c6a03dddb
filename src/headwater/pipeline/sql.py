"""Small helpers for the SQL text the pipeline's steps generate (DuckDB's dialect).

The steps run in each Spark task as one DuckDB query over the task's Arrow batches
(``headwater.pipeline.program``); every piece of that query is built as text by these helpers,
so quoting and escaping live in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

NULL = "NULL"
TRUE = "true"
FALSE = "false"


def ident(name: str) -> str:
    """A quoted identifier (any text may be a column name)."""
    return '"' + name.replace('"', '""') + '"'


def lit(value: Any) -> str:
    """A SQL literal for a JSON scalar (text, number, boolean, null)."""
    if value is None:
        return NULL
    if isinstance(value, bool):
        return TRUE if value else FALSE
    if isinstance(value, int):
        return f"{value}::BIGINT"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no SQL literal")
        return f"{value!r}::DOUBLE"
    return "'" + str(value).replace("'", "''") + "'"


def field(base: str, path: Sequence[str]) -> str:
    """``base.a.b`` for a struct's field by path (names quoted)."""
    return ".".join([base, *(ident(p) for p in path)])


def count(text: str, needle: str) -> str:
    """How many times ``needle`` (ASCII) occurs in ``text``: by replacement, which DuckDB does
    with a fast byte search (no regular expression)."""
    return f"((strlen({text}) - strlen(replace({text}, {lit(needle)}, ''))) // {len(needle)})"


def any_of(conditions: Iterable[str]) -> str:
    parts = list(conditions)
    if not parts:
        return FALSE
    return parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")"


def all_of(conditions: Iterable[str]) -> str:
    parts = list(conditions)
    if not parts:
        return TRUE
    return parts[0] if len(parts) == 1 else "(" + " AND ".join(parts) + ")"


def in_list(value: str, options: Iterable[str]) -> str:
    """``value IN (...)`` over text options (false for none)."""
    items = sorted(set(options))
    if not items:
        return FALSE
    return f"{value} IN ({', '.join(lit(o) for o in items)})"


def case(branches: Iterable[tuple[str, str]], otherwise: str = NULL) -> str:
    """``CASE WHEN c THEN v ... ELSE otherwise END`` (just ``otherwise`` with no branch)."""
    parts = [f"WHEN {c} THEN {v}" for c, v in branches]
    if not parts:
        return otherwise
    tail = "" if otherwise == NULL else f" ELSE {otherwise}"
    return f"CASE {' '.join(parts)}{tail} END"
