"""Step 1, decode: the record's bytes become ``event``, a VARIANT object.

- Event types with a registered protobuf descriptor (``pipeline.protobuf``) are decoded with it.
- JSON (content type ``application/json`` or ``*+json``) is parsed; invalid JSON and JSON that
  is not an object fail the event (``HW-PIPE-101``, ``HW-PIPE-102``).
- Other bytes that are a JSON object are taken as one (Raccoon clients often put JSON in
  ``event_bytes``, which arrive labelled ``application/x-protobuf``).
- Anything else is kept as bytes: ``{"_raw_base64": "<the bytes, base64>"}``.

Events decoded from JSON text (or protobuf's JSON form) keep that text in ``_hw_json_text``
for the context step, which adds its fields to the text and parses once (see there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline.columns import (
    ERROR,
    ERROR_TYPE,
    EVENT,
    JSON_TEXT,
    JSON_WHITESPACE,
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


def decode(df: DataFrame, protobuf: Mapping[str, ProtobufType] | None = None) -> DataFrame:
    """Add ``event`` (and ``_hw_error`` where decoding failed)."""
    if ERROR not in df.columns:
        df = df.withColumn(ERROR, F.lit(None).cast(ERROR_TYPE))
    content_type = F.lower(F.coalesce(header(context.CONTENT_TYPE), F.lit("")))
    text = F.col("value").cast("string")
    json_like = content_type.startswith("application/json") | content_type.contains("+json")
    sniffed = ~json_like & F.ltrim(text).startswith("{") & F.try_parse_json(text).isNotNull()
    is_json = json_like | sniffed
    is_proto: Column = F.lit(False)
    if protobuf:
        from headwater.pipeline.steps.protobuf import protobuf_to_json

        df = df.withColumn(
            "_hw_proto", protobuf_to_json(F.col("value"), header(context.TYPE), protobuf)
        )
        is_proto = F.col("_hw_proto").isNotNull()
        source_json = F.when(is_proto, F.col("_hw_proto")["json"]).when(is_json, text)
    else:
        source_json = F.when(is_json, text)
    df = df.withColumn("_hw_json", F.try_parse_json(source_json))
    parsed = F.col("_hw_json")
    kind = F.schema_of_variant(parsed)  # costly (the whole value's schema): errors only
    # JSON text that parses and starts with "{" is an object (cheap, unlike asking the variant)
    is_object = parsed.isNotNull() & F.ltrim(source_json, F.lit(JSON_WHITESPACE)).startswith("{")
    raw = F.to_variant_object(F.struct(F.base64(F.col("value")).alias(RAW_FIELD)))
    event = F.when(is_proto | is_json, F.when(is_object, parsed)).otherwise(raw)
    error = F.when(F.col(ERROR).isNotNull(), F.col(ERROR))
    if protobuf:
        error = error.when(
            is_proto & F.col("_hw_proto")["json"].isNull(),
            failure(STEP, INVALID_PROTOBUF, F.col("_hw_proto")["error"]),
        )
    error = error.when(
        (is_proto | is_json) & parsed.isNull(),
        failure(STEP, INVALID_JSON, "the value is not valid JSON"),
    ).when(
        (is_proto | is_json) & ~is_object,
        failure(
            STEP,
            NOT_AN_OBJECT,
            F.concat(F.lit("the JSON value is not an object but "), F.lower(F.split(kind, "<")[0])),
        ),
    )
    out = (
        df.withColumn(EVENT, event)
        .withColumn(ERROR, error)
        .withColumn(JSON_TEXT, F.when(is_object & F.col(ERROR).isNull(), source_json))
        .drop("_hw_json")
    )
    return out.drop("_hw_proto") if protobuf else out
