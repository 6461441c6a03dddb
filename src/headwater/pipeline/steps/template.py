"""The table name template: text with ``{{ ... }}`` substitutions, compiled to SQL.

Grammar (small on purpose: no code runs, every template compiles to one expression)::

    template    := (text | "{{" expr "}}")*
    expr        := source ("|" filter)*
    source      := field path (a.b.c, or /a/b/c) | "$topic" | "$type" | "$source" | "$date"
    filter      := "lower" | "upper" | "slug" | "default(" quoted ")" | "date"

``$type`` and ``$source`` are the record's ``type`` and ``source`` headers, ``$topic`` its topic,
``$date`` the receive date (YYYY_MM_DD). ``slug`` keeps letters, digits and ``_``; ``date``
turns a timestamp field into YYYY_MM_DD. A field that is missing (or null) makes the evaluation
fail unless a ``default`` follows it; a field holding an object or array fails too. Evaluation
gives ``(name, error)``: an empty name means "skip this event for the destination".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from headwater.bus import context
from headwater.errors import ConfigError
from headwater.pipeline import sql
from headwater.pipeline.columns import header, pointer_parts
from headwater.pipeline.fields import RAW, Fields, any_present, as_text, subtree, timestamp_of
from headwater.pipeline.shape import JSON
from headwater.pipeline.steps.context import received_at

_SUBST = re.compile(r"\{\{(.*?)\}\}", re.S)
_FIELD = re.compile(r"^/?[A-Za-z0-9_$@\-]+([./][A-Za-z0-9_$@\-]+)*$")
_DEFAULT = re.compile(r"""^default\(\s*(?:'([^']*)'|"([^"]*)")\s*\)$""")
VARIABLES = ("$topic", "$type", "$source", "$date")
FILTERS = ("lower", "upper", "slug", "date", "default(...)")


class TemplateError(ConfigError):
    code = "HW-CFG-010"


@dataclass(frozen=True)
class CompiledTemplate:
    name: str  # SQL: the table name ("" to skip), NULL where evaluation failed
    error: str  # SQL: why evaluation failed, else NULL
    headers: tuple[str, ...]  # the record headers it reads


def compile_template(template: str, fields: Fields | None = None) -> CompiledTemplate:
    """Compile ``template`` for events of ``fields`` (None: check the template only);
    ``TemplateError`` names what is wrong in it."""
    parts: list[str] = []
    errors: list[str] = []
    headers: list[str] = []
    pos = 0
    for m in _SUBST.finditer(template):
        if m.start() > pos:
            parts.append(sql.lit(_literal(template[pos : m.start()], template)))
        value, error = _expr(m.group(1).strip(), template, fields or {}, headers)
        parts.append(value)
        if error is not None:
            errors.append(error)
        pos = m.end()
    if pos < len(template):
        parts.append(sql.lit(_literal(template[pos:], template)))
    name = "(" + " || ".join(parts) + ")" if parts else "''"
    error = (
        errors[0] if len(errors) == 1 else f"COALESCE({', '.join(errors)})" if errors else sql.NULL
    )
    if error != sql.NULL:
        name = f"CASE WHEN {error} IS NULL THEN {name} END"
    return CompiledTemplate(name, error, tuple(dict.fromkeys(headers)))


def _literal(text: str, template: str) -> str:
    if "{{" in text or "}}" in text:
        raise TemplateError(f"table_name_template {template!r}: unbalanced '{{{{' or '}}}}'")
    return text


def _expr(expr: str, template: str, fields: Fields, headers: list[str]) -> tuple[str, str | None]:
    pieces = [p.strip() for p in expr.split("|")]
    source, filters = pieces[0], pieces[1:]
    if not source:
        raise TemplateError(f"table_name_template {template!r}: an empty {{{{ }}}}")
    error: str | None = None
    if source.startswith("$"):
        value = _variable(source, template, headers)
    elif _FIELD.match(source):
        path = pointer_parts(source) if "/" in source else tuple(source.split("."))
        value, not_scalar = _field(path, fields)
        dotted = ".".join(path)
        error = sql.case(
            [
                (
                    not_scalar,
                    sql.lit(f"table_name_template: field {dotted} is not a text or number"),
                ),
                (f"{value} IS NULL", sql.lit(f"table_name_template: field {dotted} is missing")),
            ]
        )
    else:
        raise TemplateError(
            f"table_name_template {template!r}: {source!r} is neither a field path (a.b, /a/b) "
            f"nor one of {', '.join(VARIABLES)}"
        )
    for f in filters:
        m = _DEFAULT.match(f)
        if m is not None:
            fallback = m.group(1) if m.group(1) is not None else m.group(2)
            value = f"COALESCE({value}, {sql.lit(fallback)})"
            error = None
        elif f == "lower":
            value = f"lower({value})"
        elif f == "upper":
            value = f"upper({value})"
        elif f == "slug":
            value = f"regexp_replace({value}, '[^0-9A-Za-z_]+', '_', 'g')"
        elif f == "date":
            value = f"strftime({timestamp_of(value)}, '%Y_%m_%d')"
        else:
            raise TemplateError(
                f"table_name_template {template!r}: unknown filter {f!r} "
                f"(one of: {', '.join(FILTERS)})"
            )
    return value, error


def _field(path: tuple[str, ...], fields: Fields) -> tuple[str, str]:
    """The field's value as text, and whether it holds an object or array (per row)."""
    leaf = fields.get(path)
    if leaf is not None:
        if leaf.form == RAW and JSON in leaf.kinds:
            is_json = f"(ascii({leaf.sql}) IN (123, 91))"
            return (
                f"CASE WHEN NOT {is_json} THEN {as_text(leaf)} END",
                f"COALESCE({is_json}, false)",
            )
        return as_text(leaf), sql.FALSE
    below = subtree(fields, path)
    if below:
        return sql.NULL, any_present(below)
    return "NULL::VARCHAR", sql.FALSE


def _variable(name: str, template: str, headers: list[str]) -> str:
    if name == "$topic":
        return '"topic"'
    if name in ("$type", "$source"):
        wanted = context.TYPE if name == "$type" else context.SOURCE
        headers.append(wanted)
        return sql.ident(header(wanted))
    if name == "$date":
        headers.append(context.RECEIVED_AT)
        return f"strftime({received_at()}, '%Y_%m_%d')"
    raise TemplateError(
        f"table_name_template {template!r}: unknown variable {name!r} "
        f"(one of: {', '.join(VARIABLES)})"
    )
