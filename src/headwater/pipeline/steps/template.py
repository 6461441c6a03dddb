"""The table name template: text with ``{{ ... }}`` substitutions, compiled to a Spark Column.

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

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DataType,
    MapType,
    StructType,
    TimestampType,
    VariantType,
)

from headwater.bus import context
from headwater.errors import ConfigError
from headwater.pipeline.columns import EVENT, header, pointer_parts
from headwater.pipeline.shape import JSON, variant_kind
from headwater.pipeline.structs import get_path, type_at

_SUBST = re.compile(r"\{\{(.*?)\}\}", re.S)
_FIELD = re.compile(r"^/?[A-Za-z0-9_$@\-]+([./][A-Za-z0-9_$@\-]+)*$")
_DEFAULT = re.compile(r"""^default\(\s*(?:'([^']*)'|"([^"]*)")\s*\)$""")
VARIABLES = ("$topic", "$type", "$source", "$date")
FILTERS = ("lower", "upper", "slug", "date", "default(...)")


class TemplateError(ConfigError):
    code = "HW-CFG-010"


@dataclass(frozen=True)
class CompiledTemplate:
    name: Column  # the table name ("" to skip), null where evaluation failed
    error: Column  # why evaluation failed, else null


def compile_template(template: str, struct: DataType | None = None) -> CompiledTemplate:
    """Compile ``template`` for events of type ``struct`` (None: check the template only);
    ``TemplateError`` names what is wrong in it."""
    parts: list[Column] = []
    errors: list[Column] = []
    pos = 0
    for m in _SUBST.finditer(template):
        if m.start() > pos:
            parts.append(F.lit(_literal(template[pos : m.start()], template)))
        value, error = _expr(m.group(1).strip(), template, struct)
        parts.append(value)
        if error is not None:
            errors.append(error)
        pos = m.end()
    if pos < len(template):
        parts.append(F.lit(_literal(template[pos:], template)))
    name = F.concat(*parts) if parts else F.lit("")
    error = F.coalesce(*errors) if errors else F.lit(None).cast("string")
    return CompiledTemplate(name=F.when(error.isNull(), name), error=error)


def _literal(text: str, template: str) -> str:
    if "{{" in text or "}}" in text:
        raise TemplateError(f"table_name_template {template!r}: unbalanced '{{{{' or '}}}}'")
    return text


def _expr(expr: str, template: str, struct: DataType | None) -> tuple[Column, Column | None]:
    pieces = [p.strip() for p in expr.split("|")]
    source, filters = pieces[0], pieces[1:]
    if not source:
        raise TemplateError(f"table_name_template {template!r}: an empty {{{{ }}}}")
    error: Column | None = None
    if source.startswith("$"):
        value = _variable(source, template)
    elif _FIELD.match(source):
        path = pointer_parts(source) if "/" in source else tuple(source.split("."))
        value, not_scalar = _field(path, struct)
        dotted = ".".join(path)
        error = F.when(
            not_scalar, F.lit(f"table_name_template: field {dotted} is not a text or number")
        ).when(value.isNull(), F.lit(f"table_name_template: field {dotted} is missing"))
    else:
        raise TemplateError(
            f"table_name_template {template!r}: {source!r} is neither a field path (a.b, /a/b) "
            f"nor one of {', '.join(VARIABLES)}"
        )
    for f in filters:
        m = _DEFAULT.match(f)
        if m is not None:
            fallback = m.group(1) if m.group(1) is not None else m.group(2)
            value = F.coalesce(value, F.lit(fallback))
            error = None
        elif f == "lower":
            value = F.lower(value)
        elif f == "upper":
            value = F.upper(value)
        elif f == "slug":
            value = F.regexp_replace(value, r"[^0-9A-Za-z_]+", "_")
        elif f == "date":
            value = F.date_format(F.try_to_timestamp(value), "yyyy_MM_dd")
        else:
            raise TemplateError(
                f"table_name_template {template!r}: unknown filter {f!r} "
                f"(one of: {', '.join(FILTERS)})"
            )
    return value, error


def _field(path: tuple[str, ...], struct: DataType | None) -> tuple[Column, Column]:
    """The field's value as text, and whether it holds an object or array (per row)."""
    kind = type_at(struct, path) if struct is not None else None
    got = get_path(F.col(EVENT), struct, path) if struct is not None else None
    if got is None or kind is None:
        return F.lit(None).cast("string"), F.lit(False)
    if isinstance(kind, StructType | ArrayType | MapType):
        return F.lit(None).cast("string"), got.isNotNull()
    if isinstance(kind, VariantType):
        k = variant_kind(got)
        return F.when(k != JSON, F.try_variant_get(got, "$", "string")), k == JSON
    if isinstance(kind, TimestampType):
        return F.date_format(got, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"), F.lit(False)
    return got.cast("string"), F.lit(False)


def _variable(name: str, template: str) -> Column:
    if name == "$topic":
        return F.col("topic")
    if name == "$type":
        return header(context.TYPE)
    if name == "$source":
        return header(context.SOURCE)
    if name == "$date":
        received = F.coalesce(F.try_to_timestamp(header(context.RECEIVED_AT)), F.col("timestamp"))
        return F.date_format(received, "yyyy_MM_dd")
    raise TemplateError(
        f"table_name_template {template!r}: unknown variable {name!r} "
        f"(one of: {', '.join(VARIABLES)})"
    )
