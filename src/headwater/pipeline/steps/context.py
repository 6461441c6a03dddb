"""Step 2, context enrichment: what the collector recorded in the headers goes into the event,
under the names Jitsu's pipeline uses (seed 002, "ContextEnrichment step"):

| field | from header | |
|---|---|---|
| ``source_ip`` | ``client-ip`` | the client's address (trusted proxies honoured) |
| ``_timestamp`` | ``received-at`` | UTC receive time, ISO 8601 text (else the record's time) |
| ``api_key`` | ``source`` | the id of the source whose write key was used (never the key) |
| ``src`` | ``protocol`` | the intake: raccoon-ws, segment, jitsu, otlp, ... |
| ``eventn_ctx.event_id`` | ``event-id`` | the UUIDv7 given on receipt |
| ``eventn_ctx.user_agent`` | ``user-agent`` | the client's User-Agent |
| ``event_type`` | ``type`` | only when the event has no ``event_type`` of its own |

Context fields replace what a client sent under the same names: they are the server's facts.

How: setting a field in a VARIANT rebuilds the whole value, so seven fields set one by one
cost seven rebuilds per event. Events decoded from JSON text (``_hw_json_text``, nearly all)
instead get the fields added to their text, which is parsed once. Where that cannot be done
simply (the client sent one of the fields itself, so the text would hold a key twice; or it
sent an ``eventn_ctx`` object, whose other fields must stay), the fields are set one by one.
"""

from __future__ import annotations

import operator
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline.columns import (
    EVENT,
    JSON_TEXT,
    JSON_WHITESPACE,
    header,
    json_path,
    with_event,
)

SPLICED = "_hw_spliced"
CTX = "eventn_ctx"

FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("source_ip",), context.CLIENT_IP),
    (("api_key",), context.SOURCE),
    (("src",), context.PROTOCOL),
    ((CTX, "event_id"), context.EVENT_ID),
    ((CTX, "user_agent"), context.USER_AGENT),
)


def set_if(event: Column, path: tuple[str, ...], value: Column) -> Column:
    """``event`` with ``value`` at ``path``, unchanged where ``value`` is null."""
    return F.when(value.isNull(), event).otherwise(F.variant_set(event, json_path(path), value))


def received_at() -> Column:
    """The receive time as UTC ISO 8601 text (the same text by either path)."""
    at = F.coalesce(F.try_to_timestamp(header(context.RECEIVED_AT)), F.col("timestamp"))
    return F.date_format(at, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX")


def _inner(obj: Column) -> Column:
    """The text between an object's braces (``obj``: JSON object text without outer spaces)."""
    return F.substring(obj, F.lit(2), F.length(obj) - 2)


def _own(text: Column, key: str) -> Column:
    """Whether the client's JSON text may hold ``key`` itself (a cheap test on the text)."""
    return text.contains(f'"{key}"')


def _spliced(text: Column) -> Column:
    """The event's JSON text with the context fields added; null when a field the text holds
    already would be a second key (parsing then fails and the fields are set one by one)."""
    top = [header(name).alias(path[0]) for path, name in FIELDS if len(path) == 1]
    nested = {path[1]: header(name) for path, name in FIELDS if path[0] == CTX}
    ctx = F.struct(*[value.alias(key) for key, value in nested.items()])
    any_ctx = reduce(operator.or_, [value.isNotNull() for value in nested.values()])
    fields = F.struct(
        *top,
        received_at().alias("_timestamp"),
        F.when(~_own(text, CTX) & any_ctx, ctx).alias(CTX),
        F.when(~_own(text, "event_type"), header(context.TYPE)).alias("event_type"),
    )
    inner = _inner(F.trim(text, F.lit(JSON_WHITESPACE)))
    added = _inner(F.to_json(fields))  # nulls are left out
    parts = [
        F.when(F.trim(inner, F.lit(JSON_WHITESPACE)) != "", inner),
        F.when(added != "", added),
    ]
    return F.try_parse_json(F.concat(F.lit("{"), F.concat_ws(",", *parts), F.lit("}")))


def enrich_context(df: DataFrame) -> DataFrame:
    """Add the context fields to ``event`` (rows without an event pass through)."""
    done = F.lit(False)
    ctx_done = F.lit(False)
    if JSON_TEXT in df.columns:
        text = F.col(JSON_TEXT)
        df = df.withColumn(SPLICED, _spliced(text))
        df = with_event(df, F.coalesce(F.col(SPLICED), F.col(EVENT)))
        done = F.col(SPLICED).isNotNull()
        ctx_done = done & ~_own(text, CTX)
    for path, name in FIELDS:
        finished = ctx_done if path[0] == CTX else done
        event = F.col(EVENT)
        df = with_event(df, F.when(finished, event).otherwise(set_if(event, path, header(name))))
    event = F.col(EVENT)
    df = with_event(
        df, F.when(done, event).otherwise(set_if(event, ("_timestamp",), received_at()))
    )
    event = F.col(EVENT)
    has_type = F.variant_get(event, json_path(("event_type",)), "variant").isNotNull()
    df = with_event(
        df, F.when(has_type, event).otherwise(set_if(event, ("event_type",), header(context.TYPE)))
    )
    return df.drop(SPLICED, JSON_TEXT)
