"""Names the pipeline's program shares between its steps, the task that runs it and the driver.

Each Spark task turns its Arrow batches (the source's layout: ``key, value, topic, partition,
offset, timestamp, timestampType, headers``) into the program's *input* relation:

- ``key``, ``value``, ``topic``, ``partition``, ``offset``, ``timestamp``, ``headers`` as the
  source gives them, and ``_hw_session`` (a delivering destination's session key) or NULL;
- ``_hw_row``: the row's position in the task's chunk (to find a failed row's source record);
- ``_hw_utf8``: the value as text when it is valid UTF-8 (else NULL);
- ``_hw_order``: the row's place in the batch (partition, then offset);
- one column per record header a step reads (``header(name)``);
- ``_hw_proto_json`` and ``_hw_proto_error`` when protobuf types are registered;
- ``_hw_shape_error`` when contracts or Python functions run before the query
  (``headwater.pipeline.shaping``: they may also change an event's text, drop its row, or make
  several rows of it).

The program's output has, per row: ``_hw_table`` (the normalised target table; "" for rows
skipped, failed or of tables not known yet), ``_hw_error`` (``struct(step, code, reason)`` or
NULL), ``_hw_novel``, ``_hw_routed`` and ``_hw_json`` for novel rows (what the task learns from),
``_hw_row``, ``_hw_order`` and every table's columns.
"""

from __future__ import annotations

import pyarrow as pa

from headwater.destinations.base import ORDER_COLUMN, SESSION_COLUMN

INPUT = "hw_input"  # the relation the task registers with DuckDB
ROW = "_hw_row"
UTF8 = "_hw_utf8"
ORDER = ORDER_COLUMN
SESSION = SESSION_COLUMN  # the row's session key, when the source frame has one (else NULL)
PROTO_JSON = "_hw_proto_json"
PROTO_ERROR = "_hw_proto_error"
SHAPE_ERROR = "_hw_shape_error"  # why contracts or a Python function failed the event
JSON_TEXT = "_hw_json"  # the event as JSON text (decode)
PARSED = "_hw_e"  # the event parsed against the shape: a struct
ERROR = "_hw_error"
TABLE = "_hw_table"
ROUTED = "_hw_routed"
NOVEL = "_hw_novel"
SOURCE_COLUMNS = (
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
)
_HEADER_PREFIX = "_hw_h_"


def header(name: str) -> str:
    """The input column holding record header ``name`` (its first value, as text)."""
    return _HEADER_PREFIX + name


def header_name(column: str) -> str | None:
    """The header an input column holds (None for other columns)."""
    return column[len(_HEADER_PREFIX) :] if column.startswith(_HEADER_PREFIX) else None


def failure(step: str, code: str, reason: str) -> str:
    """An ``_hw_error`` value (``reason`` is a SQL text expression)."""
    from headwater.pipeline.sql import lit

    return f"struct_pack(step := {lit(step)}, code := {lit(code)}, reason := {reason})"


def pointer_parts(pointer: str) -> tuple[str, ...]:
    """``/a/b`` (the mapping rules' JSON path form, leading ``/`` optional) as ``("a", "b")``."""
    return tuple(p for p in pointer.strip().split("/") if p)


def utf8_or_null(values: pa.Array, *, replace: bool = False) -> pa.Array:
    """``values`` (binary) as text: the same buffers seen as text when they are valid UTF-8
    (checked by Arrow in one pass, no copy); else, per value, null (or with replacement
    characters when ``replace``)."""
    text = values.view(pa.string())
    try:
        text.validate(full=True)
        return text
    except pa.ArrowInvalid:
        pass
    out = []
    for v in values.to_pylist():
        if v is None:
            out.append(None)
            continue
        try:
            out.append(v.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(v.decode("utf-8", "replace") if replace else None)
    return pa.array(out, pa.string())
