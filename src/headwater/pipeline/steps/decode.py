"""Step 1, decode: the record's bytes become ``event``, a struct parsed once from JSON text.

- Event types with a registered protobuf descriptor (``pipeline.protobuf``) are decoded with it
  to their JSON form.
- JSON (content type ``application/json`` or ``*+json``) is taken as is; invalid JSON and JSON
  that is not an object fail the event (``HW-PIPE-101``, ``HW-PIPE-102``).
- Other bytes that are a JSON object are taken as one (Raccoon clients often put JSON in
  ``event_bytes``, which arrive labelled ``application/x-protobuf``).
- Anything else is kept as bytes: ``{"_raw_base64": "<the bytes, base64>"}``.

The JSON text (``_hw_json_text``) is parsed with ``from_json`` against the destination's carried
shape (``headwater.pipeline.shape``); ``_hw_novel`` marks the events that hold something the
shape does not know. Only those are checked strictly (a VARIANT parse tells invalid JSON and
non-objects apart) and inferred; the writer then widens the shape and plans the batch again.
Without a shape (``shape=None``: tests, one-off use) the batch's own shape is inferred first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline import shape as sh
from headwater.pipeline.columns import (
    ERROR,
    ERROR_TYPE,
    EVENT,
    JSON_TEXT,
    JSON_WHITESPACE,
    NOVEL,
    failure,
    header,
)

if TYPE_CHECKING:
    from headwater.pipeline.config import ProtobufType

STEP = "decode"
INVALID_JSON = "HW-PIPE-101"
NOT_AN_OBJECT = "HW-PIPE-102"
INVALID_PROTOBUF = "HW-PIPE-103"
RAW_FIELD = "_raw_base64"
PROTO = "_hw_proto"
PARSED = "_hw_parsed"


def json_text(df: DataFrame, protobuf: Mapping[str, ProtobufType] | None = None) -> DataFrame:
    """Add ``_hw_json_text`` (the event as JSON text, raw bytes wrapped) and ``_hw_error`` where
    protobuf decoding failed."""
    if ERROR not in df.columns:
        df = df.withColumn(ERROR, F.lit(None).cast(ERROR_TYPE))
    content_type = F.lower(F.coalesce(header(context.CONTENT_TYPE), F.lit("")))
    text = F.col("value").cast("string")
    json_like = content_type.startswith("application/json") | content_type.contains("+json")
    sniffed = (
        ~json_like
        & F.ltrim(text, F.lit(JSON_WHITESPACE)).startswith("{")
        & F.try_parse_json(text).isNotNull()
    )
    raw = F.concat(F.lit('{"' + RAW_FIELD + '":"'), F.base64(F.col("value")), F.lit('"}'))
    source = F.when(json_like | sniffed, text).otherwise(raw)
    error = F.col(ERROR)
    if protobuf:
        from headwater.pipeline.steps.protobuf import protobuf_to_json

        df = df.withColumn(PROTO, protobuf_to_json(F.col("value"), header(context.TYPE), protobuf))
        proto = F.col(PROTO)
        source = F.when(proto.isNotNull(), proto["json"]).otherwise(source)
        error = F.when(F.col(ERROR).isNotNull(), F.col(ERROR)).when(
            proto.isNotNull() & proto["json"].isNull(),
            failure(STEP, INVALID_PROTOBUF, proto["error"]),
        )
    out = df.withColumn(JSON_TEXT, F.when(error.isNull(), source)).withColumn(ERROR, error)
    return out.drop(PROTO) if protobuf else out


def strict_error(text: Column) -> Column:
    """Why ``text`` is not a JSON object (null when it is one): the precise, costlier check."""
    parsed = F.try_parse_json(text)
    kind = F.lower(F.split(F.schema_of_variant(parsed), "<")[0])
    is_object = F.ltrim(text, F.lit(JSON_WHITESPACE)).startswith("{")
    return F.when(parsed.isNull(), failure(STEP, INVALID_JSON, "the value is not valid JSON")).when(
        ~is_object,
        failure(STEP, NOT_AN_OBJECT, F.concat(F.lit("the JSON value is not an object but "), kind)),
    )


def infer_shape(df: DataFrame) -> sh.Shape:
    """The shape of the events in ``df`` (``_hw_json_text``), from their VARIANT parse."""
    text = F.col(JSON_TEXT)
    is_object = F.ltrim(text, F.lit(JSON_WHITESPACE)).startswith("{")
    parsed = df.where(is_object).select(F.try_parse_json(text).alias("v"))
    out = sh.Shape()
    out.merge(sh.infer(parsed, "v"))
    return out


def parse(df: DataFrame, shape: sh.Shape) -> DataFrame:
    """Add ``event`` (``shape``'s value schema), ``_hw_novel``, and the strict ``_hw_error`` for
    novel events that are not JSON objects; ``df`` has ``_hw_json_text``."""
    text = F.col(JSON_TEXT)
    if shape.leaves:
        # parsed once, in a projection of its own: the checks below refer to it many times,
        # and inlined each reference would parse the text again
        df = df.withColumn(PARSED, F.from_json(text, shape.text_schema()))
        parsed = F.col(PARSED)
        is_novel = sh.novel(text, parsed, shape)
        event = sh.to_values(parsed, shape)
    else:
        is_novel = F.lit(True)
        event = F.lit(None).cast("struct<`_hw_none`:string>")
    live = F.col(ERROR).isNull() & text.isNotNull()
    df = df.withColumn(NOVEL, live & is_novel)
    error = F.when(F.col(ERROR).isNotNull(), F.col(ERROR)).when(F.col(NOVEL), strict_error(text))
    df = df.withColumn(ERROR, error)
    ok = F.col(ERROR).isNull()
    out = df.withColumn(NOVEL, F.col(NOVEL) & ok).withColumn(EVENT, F.when(ok, event))
    return out.drop(PARSED) if shape.leaves else out


def decode(
    df: DataFrame,
    protobuf: Mapping[str, ProtobufType] | None = None,
    shape: sh.Shape | None = None,
) -> DataFrame:
    """Add ``event``, ``_hw_json_text``, ``_hw_novel`` (and ``_hw_error`` where decoding failed).
    Without ``shape``, the batch's own is inferred (every event then fits it)."""
    df = json_text(df, protobuf)
    if shape is None:
        shape = infer_shape(df)
    return parse(df, shape)
