"""The functions of an event destination that run in the query, after the enrichments and
before routing, in the order configured (Python functions run before the query:
``headwater.pipeline.shaping``):

- ``pick {fields: [/a, /b/c]}``: only these fields (and what is below them) are kept;
- ``omit {fields: [...]}``: these fields (and what is below them) are removed;
- ``rename {fields: {/old: /new}}``: each field (with what is below it) moves to its new path,
  replacing what was there;
- ``sql {field: /revenue_usd, expression: "properties.revenue * 1.1"}``: the field is set to the
  expression's value (replacing it if it exists);
- ``filter {expression: "event <> 'heartbeat'"}``: only the events for which the expression is
  true are kept; the others are skipped (counted), not failed.

Expressions are DuckDB SQL (the engine every task's query runs in), evaluated vectorised over
the event's fields: a top-level field is a column (``event``, ``userId``), an object a struct
(``properties.revenue``, ``context.page.url``), numbers, booleans and text as themselves, ISO
8601 text the pipeline reads as a time a ``TIMESTAMPTZ``, arrays and mixed values their JSON
text, except that a leaf holding numbers and other scalars is a number (DOUBLE; its other values
NULL). A field no event has is NULL (an ``sql`` function whose value is always NULL sets no
field). An expression that cannot be computed for an event (a cast of text that is no number)
gives NULL for it (DuckDB's ``TRY``), so one odd event never stops a batch. An expression that
does not parse, or calls a function DuckDB lacks, is a config error (``check``); its value's type
is found once per batch, on the driver, by binding it over the fields' types; one that does not
bind (text compared with a number) fails the batch with the function named.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from headwater.errors import ConfigError
from headwater.pipeline import sql
from headwater.pipeline.columns import pointer_parts
from headwater.pipeline.fields import (
    BIGINT,
    BOOLEAN,
    DOUBLE,
    RAW,
    TEXT,
    TIMESTAMP,
    Field,
    Fields,
    any_present,
    set_subtree,
    subtree,
    under,
)
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, JSON, STRING, Path

_PREFIX = "_hw_v_"  # a field's column while an expression that names it runs
_SQL_TYPES = {TEXT: "VARCHAR", TIMESTAMP: "TIMESTAMPTZ", BIGINT: "BIGINT", DOUBLE: "DOUBLE"}
_SQL_TYPES |= {BOOLEAN: "BOOLEAN", RAW: "VARCHAR"}
_INTEGERS = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER")
_NUMBERS = ("FLOAT", "DOUBLE", "DECIMAL", "HUGEINT", "UBIGINT", "UHUGEINT")


class FunctionExpressionError(ConfigError):
    """An ``sql`` or ``filter`` function's expression does not parse or bind."""

    code = "HW-PIPE-512"


@dataclass
class Applied:
    """What the functions make of the fields: the fields after them, the query stages that
    compute their expressions (each a ``SELECT`` over the one before),
    and the conditions of the events a filter drops."""

    fields: Fields
    stages: list[str]
    drops: list[str]


def apply(fields: Fields, functions: Sequence[Any]) -> Applied:
    """``fields`` after the destination's query functions (Python ones are skipped: they ran
    before the query)."""
    stages: list[str] = []
    drops: list[str] = []
    for i, fn in enumerate(functions):
        name = fn.name
        if name == "python":
            continue
        if name == "pick":
            kept = [pointer_parts(f) for f in fn.fields]
            fields = {p: f for p, f in fields.items() if any(under(p, k) for k in kept)}
        elif name == "omit":
            gone = [pointer_parts(f) for f in fn.fields]
            fields = {p: f for p, f in fields.items() if not any(under(p, g) for g in gone)}
        elif name == "rename":
            for old, new in fn.fields.items():
                src, dst = pointer_parts(old), pointer_parts(new)
                moving = subtree(fields, src)
                if moving:
                    rest = {p: f for p, f in fields.items() if not under(p, src)}
                    fields = set_subtree(rest, dst, moving, any_present(moving))
        elif name in ("sql", "filter"):
            column = f"_hw_f{i}"
            form, kinds, value = _typed(fields, fn.expression, fn.label)
            stages += _stages(fields, fn.expression, column, value)
            if name == "filter":
                drops.append(f"NOT COALESCE({sql.ident(column)}, false)")
            else:
                at = pointer_parts(fn.field)
                made = {(): Field(at, sql.ident(column), form, kinds)} if form else {}
                fields = set_subtree(fields, at, made, None)  # no value known: no field
        else:
            raise ConfigError(f"function {fn.label} does not apply to events")
    return Applied(fields, stages, drops)


def _stages(fields: Fields, expression: str, column: str, value: str) -> list[str]:
    """Two stages: the fields the expression names as columns of their own (top-level ones,
    objects as structs), then the expression's value (``value`` wraps it: a cast, ``TRY``)."""
    refs = referenced(expression)
    tops = sorted({r[0] for r in refs})
    columns = _columns(fields, refs, tops)
    own = ", ".join(sql.ident(_PREFIX + t) for t in tops)
    stages = [f"SELECT *, {columns}"] if columns else []
    rest = f"* EXCLUDE ({own})" if own else "*"
    return [*stages, f"SELECT {rest}, {value} AS {sql.ident(column)}"]


def _columns(fields: Fields, refs: Iterable[Path], tops: Iterable[str], typed: bool = False) -> str:
    """The top-level fields ``tops`` as columns named for the rewritten expression (objects as
    structs): their values, or NULLs of their types when ``typed``; ``refs`` no field has are
    NULL."""
    tree: dict[str, Any] = {}
    wanted = set(tops)
    for path, f in fields.items():
        if path[0] in wanted:
            _put(tree, path, f"NULL::{_type(f)}" if typed else _value(f))
    for path in refs:
        _put(tree, path, "NULL", replace=False)
    return ", ".join(f"{_expr(node)} AS {sql.ident(_PREFIX + n)}" for n, node in tree.items())


def _put(tree: dict[str, Any], path: Path, value: str, replace: bool = True) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            if child is not None and not replace:
                return  # a value where the path goes on: the reference finds no key
            child = node[part] = {}
        node = child
    if path and (replace or path[-1] not in node):
        node[path[-1]] = value


def _expr(node: Any) -> str:
    if isinstance(node, str):
        return node
    members = ", ".join(f"{sql.ident(k)} := {_expr(v)}" for k, v in node.items())
    return f"struct_pack({members})"


def _value(f: Field) -> str:
    if _numeric_json(f):
        return f"TRY_CAST({f.sql} AS DOUBLE)"
    return f"({f.sql})::{_SQL_TYPES[f.form]}"


def _type(f: Field) -> str:
    return "DOUBLE" if _numeric_json(f) else _SQL_TYPES[f.form]


def _numeric_json(f: Field) -> bool:
    """A leaf whose events hold numbers and other scalars: a number to expressions (the other
    values NULL), as arithmetic on it is what an expression does with it."""
    return f.form == RAW and JSON not in f.kinds and bool(f.kinds & {INT64, FLOAT64})


def referenced(expression: str) -> list[Path]:
    """The field paths ``expression`` names (its column references), by DuckDB's own parser;
    ``FunctionExpressionError`` when it does not parse."""
    return _parsed(expression)[1]


def rewritten(expression: str) -> str:
    """``expression`` with each field it names renamed as ``_stages`` makes their columns (so
    no field is confused with the query's own columns: ``value``, ``offset``...)."""
    return _parsed(expression)[0]


@functools.lru_cache(maxsize=256)
def _parsed(expression: str) -> tuple[str, list[Path]]:
    import duckdb

    con = duckdb.connect()
    try:
        text = con.execute("SELECT json_serialize_sql(?)", [f"SELECT {expression}"]).fetchone()
        assert text is not None
        tree = json.loads(text[0])
        if tree.get("error"):
            raise FunctionExpressionError(
                f"the expression {expression!r} does not parse: {tree.get('error_message', '?')}"
            )
        statements = tree["statements"]
        if len(statements) != 1 or len(statements[0]["node"]["select_list"]) != 1:
            raise FunctionExpressionError(f"the expression {expression!r} is not one expression")
        refs: list[Path] = []

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                if node.get("class") == "COLUMN_REF":
                    names = node["column_names"]
                    refs.append(tuple(names))
                    names[0] = _PREFIX + names[0]
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(statements[0]["node"]["select_list"])
        back = con.execute("SELECT json_deserialize_sql(?)", [json.dumps(tree)]).fetchone()
        assert back is not None
        return str(back[0]).removeprefix("SELECT "), refs
    finally:
        con.close()


def check(expression: str, label: str) -> None:
    """Raise ``FunctionExpressionError`` unless ``expression`` parses and binds over fields of
    any type (NULLs): a syntax error or an unknown function is found before any event (what
    depends on the fields' types is bound per batch)."""
    try:
        _bind({}, expression, label)
    except FunctionExpressionError as e:
        if "Binder Error" not in e.message:
            raise


def _bind(fields: Fields, expression: str, label: str) -> str:
    """The DuckDB type of ``expression``'s value over NULLs of the ``fields``' types (the
    fields it names that ``fields`` lacks: untyped NULLs)."""
    import duckdb

    refs = referenced(expression)
    columns = _columns(fields, refs, {r[0] for r in refs}, typed=True) or "NULL AS _hw_none"
    probe = f"SELECT TRY({rewritten(expression)}) AS v FROM (SELECT {columns})"
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone = 'UTC'")
        return str(con.execute(f"DESCRIBE {probe}").fetchall()[0][1])
    except duckdb.Error as e:
        raise FunctionExpressionError(f"function {label}: {str(e).splitlines()[0]}") from None
    finally:
        con.close()


def _typed(fields: Fields, expression: str, label: str) -> tuple[str, frozenset[str], str]:
    """The form and kinds of the expression's value over ``fields`` (no form: it has no value,
    it names only fields no event has), and the SQL that gives it in that form."""
    try:
        base = _bind(fields, expression, label).split("(")[0]
    except FunctionExpressionError:
        missing = [r for r in referenced(expression) if not any(under(p, r) for p in fields)]
        if missing:  # no event has what it reads (yet): no value
            return "", frozenset(), "NULL"
        raise
    tried = f"TRY({rewritten(expression)})"
    if base in ("VARCHAR", "UUID"):
        return TEXT, frozenset({STRING}), f"({tried})::VARCHAR"
    if base == "BOOLEAN":
        return BOOLEAN, frozenset({BOOL}), tried
    if base in _INTEGERS:
        return BIGINT, frozenset({INT64}), f"({tried})::BIGINT"
    if base in _NUMBERS:
        return DOUBLE, frozenset({FLOAT64}), f"({tried})::DOUBLE"
    if base.startswith("TIMESTAMP") or base == "DATE":
        return TIMESTAMP, frozenset({STRING}), f"({tried})::TIMESTAMPTZ"
    if base in ('"NULL"', "NULL"):  # only fields no event has: no value
        return "", frozenset(), "NULL"
    return RAW, frozenset({JSON}), f"to_json({tried})::VARCHAR"
