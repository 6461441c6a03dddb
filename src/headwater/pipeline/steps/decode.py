"""Step 1, decode: the record's bytes become the event's JSON text, parsed once against the shape.

- Event types with a registered protobuf descriptor (``pipeline.protobuf``) are decoded with it
  to their JSON form (``headwater.pipeline.steps.protobuf``, before the query runs).
- JSON (content type ``application/json`` or ``*+json``) is taken as is; invalid JSON and JSON
  that is not an object fail the event (``HW-PIPE-101``, ``HW-PIPE-102``).
- Other bytes that are a JSON object are taken as one (Raccoon clients often put JSON in
  ``event_bytes``, which arrive labelled ``application/x-protobuf``).
- Anything else is kept as bytes: ``{"_raw_base64": "<the bytes, base64>"}``.

The text is parsed with DuckDB's ``json_transform`` against the destination's carried shape
(``Shape.structure``): one ``Field`` per known leaf (``fields``). ``novel`` marks the events that
hold something the shape does not know: a key (the keys counted on the text, which can only
count too many, never too few, against the values the parse filled), or a value of a kind the
leaf never had. Only those events are inferred, by the task, exactly.

Two variants of the query exist: the usual one assumes that text which starts like an object is
valid JSON (``json_transform`` then raises on the whole chunk if one is not: the task runs the
chunk again ``guarded``, which checks every event with ``json_valid`` first).
"""

from __future__ import annotations

from headwater.bus import context
from headwater.pipeline import sql
from headwater.pipeline.columns import (
    JSON_TEXT,
    PARSED,
    PROTO_ERROR,
    PROTO_JSON,
    UTF8,
    failure,
    header,
)
from headwater.pipeline.fields import (
    BIGINT,
    BOOLEAN,
    DOUBLE,
    RAW,
    TEXT,
    TIMESTAMP,
    Field,
    Fields,
    kind_in,
    timestamp_of,
)
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, ISO_TIMESTAMP, JSON, KINDS, Shape

STEP = "decode"
INVALID_JSON = "HW-PIPE-101"
NOT_AN_OBJECT = "HW-PIPE-102"
INVALID_PROTOBUF = "HW-PIPE-103"
RAW_FIELD = "_raw_base64"
HEADERS = (context.CONTENT_TYPE,)
_WS = " \t\r\n"
_TEXT = sql.ident(JSON_TEXT)


def _h(name: str) -> str:
    return sql.ident(header(name))


def looks_like_object(text: str) -> str:
    """The text's first non-blank character is ``{``."""
    return f"(ascii({text}) = 123 OR ascii(ltrim({text}, {sql.lit(_WS)})) = 123)"


def json_text(protobuf: bool) -> str:
    """The event's JSON text (NULL where protobuf decoding failed or JSON-labelled bytes are
    not UTF-8)."""
    content_type = f"lower(COALESCE({_h(context.CONTENT_TYPE)}, ''))"
    json_like = (
        f"(starts_with({content_type}, 'application/json') OR contains({content_type}, '+json'))"
    )
    utf8 = sql.ident(UTF8)
    sniffed = f"({utf8} IS NOT NULL AND {looks_like_object(utf8)} AND json_valid({utf8}))"
    raw = f"""('{{"{RAW_FIELD}":"' || to_base64("value") || '"}}')"""
    branches = [(json_like, utf8), (sniffed, utf8)]
    if protobuf:
        branches.insert(0, (f"{sql.ident(PROTO_ERROR)} IS NOT NULL", sql.NULL))
        branches.insert(0, (f"{sql.ident(PROTO_JSON)} IS NOT NULL", sql.ident(PROTO_JSON)))
    return sql.case(branches, raw)


def error(protobuf: bool, guarded: bool) -> str:
    """Why the event cannot be decoded (NULL when it can), over ``_hw_json``."""
    invalid = failure(STEP, INVALID_JSON, sql.lit("the value is not valid JSON"))
    kind = (
        f"CASE json_type({_TEXT}) WHEN 'ARRAY' THEN 'array' WHEN 'VARCHAR' THEN 'string' "
        f"WHEN 'BOOLEAN' THEN 'boolean' WHEN 'NULL' THEN 'null' ELSE 'number' END"
    )
    not_object = failure(STEP, NOT_AN_OBJECT, f"'the JSON value is not an object but ' || {kind}")
    branches: list[tuple[str, str]] = []
    if protobuf:
        reason = sql.ident(PROTO_ERROR)
        branches.append((f"{reason} IS NOT NULL", failure(STEP, INVALID_PROTOBUF, reason)))
    branches.append((f"{_TEXT} IS NULL", invalid))
    if guarded:
        branches.append((f"NOT json_valid({_TEXT})", invalid))
    branches.append(
        (
            f"NOT {looks_like_object(_TEXT)}",
            sql.case([(f"json_valid({_TEXT})", not_object)], invalid),
        )
    )
    return sql.case(branches)


def parse(shape: Shape) -> str:
    """The parse of ``_hw_json`` against ``shape`` (a struct; NULL for an empty shape)."""
    if not shape.leaves:
        return sql.NULL
    import json

    return f"json_transform({_TEXT}, {sql.lit(json.dumps(shape.structure()))})"


def fields(shape: Shape) -> Fields:
    """One field per leaf of ``shape``, read from the parsed struct."""
    out: Fields = {}
    for path, leaf in shape.leaves.items():
        at = sql.field(sql.ident(PARSED), path)
        if leaf.is_timestamp:
            out[path] = Field(path, timestamp_of(at), TIMESTAMP, leaf.kinds)
        elif leaf.is_text:
            out[path] = Field(path, at, TEXT, leaf.kinds)
        else:
            out[path] = _raw_leaf(path, f"{at}::VARCHAR", leaf.kinds)
    return out


def _raw_leaf(path: tuple[str, ...], raw: str, kinds: frozenset[str]) -> Field:
    if kinds == {INT64}:
        return Field(path, f"TRY_CAST({raw} AS BIGINT)", BIGINT, kinds)
    if kinds == {BOOL}:
        return Field(
            path, f"CASE {raw} WHEN 'true' THEN true WHEN 'false' THEN false END", BOOLEAN, kinds
        )
    if JSON not in kinds and kinds <= {INT64, FLOAT64}:
        return Field(path, f"TRY_CAST({raw} AS DOUBLE)", DOUBLE, kinds)
    return Field(path, raw, RAW, kinds)


def novel(shape: Shape) -> str:
    """Per event: it holds a key the shape does not know, or a value of a kind its leaf never
    held, or a date-time leaf holds other text (over ``_hw_json`` and ``_hw_e``; only for
    events that decoded)."""
    if not shape.leaves:
        return sql.TRUE
    parsed = sql.ident(PARSED)
    filled = [f"({sql.field(parsed, o)} IS NOT NULL)::INT" for o in shape.objects()]
    checks = []
    for path, leaf in shape.leaves.items():
        at = sql.field(parsed, path)
        filled.append(f"({at} IS NOT NULL)::INT")
        raw = f"{at}::VARCHAR"
        if leaf.is_timestamp:
            iso = sql.lit(ISO_TIMESTAMP)
            checks.append(f"({at} IS NOT NULL AND NOT regexp_full_match({at}, {iso}))")
        if leaf.is_text:
            continue
        if JSON in leaf.kinds:  # the keys inside objects and arrays kept whole count too
            filled.append(f"COALESCE({_inner_keys(raw)}, 0)")
        known = kind_in(Field(path, raw, RAW, frozenset(KINDS)), leaf.kinds)
        if known != sql.TRUE:
            checks.append(f"NOT {known}")
    return sql.any_of([_keys(_TEXT, " + ".join(filled)), *checks])


_KEY = '":'
_NULL_KEY = '":null'


def _inner_keys(raw: str) -> str:
    """Keys with a value inside an object or array's JSON text (as DuckDB writes it back:
    compact, so every key is ``"name":``)."""
    return f"({sql.count(raw, _KEY)} - {sql.count(raw, _NULL_KEY)})"


def _keys(text: str, filled: str) -> str:
    """The text holds more keys with a value than the parse filled. Counted on the text: every
    ``"`` followed by ``:`` (with blanks between them only in unusual texts, then by a regular
    expression), which counts keys with a null value too (subtracted only when the counts
    differ) and a ``\\":`` inside a string (such texts take the slow path)."""
    odd = f"regexp_matches({text}, '\"\\s')"
    count = sql.case([(odd, f"len(regexp_extract_all({text}, '\"\\s*:'))")], sql.count(text, '":'))
    nulls = f"len(regexp_extract_all({text}, '\"\\s*:\\s*null'))"
    return (
        f"(CASE WHEN {count} = ({filled}) THEN false WHEN contains({text}, '\\\"') THEN true "
        f"ELSE {count} - {nulls} != ({filled}) END)"
    )
