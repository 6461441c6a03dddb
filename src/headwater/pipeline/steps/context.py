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

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline.columns import EVENT, JSON_TEXT, header, json_path, with_event

SPLICED = "_hw_spliced"

FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("source_ip",), context.CLIENT_IP),
    (("api_key",), context.SOURCE),
    (("src",), context.PROTOCOL),
    (("eventn_ctx", "event_id"), context.EVENT_ID),
    (("eventn_ctx", "user_agent"), context.USER_AGENT),
)


def set_if(event: Column, path: tuple[str, ...], value: Column) -> Column:
    """``event`` with ``value`` at ``path``, unchanged where ``value`` is null."""
    return F.when(value.isNull(), event).otherwise(F.variant_set(event, json_path(path), value))


def received_at() -> Column:
    """The receive time as UTC ISO 8601 text (the same text by either path)."""
    at = F.coalesce(F.try_to_timestamp(header(context.RECEIVED_AT)), F.col("timestamp"))
    return F.date_format(at, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX")


def _spliced(text: Column) -> Column:
    """The event's JSON text with the context fields added; null when a field the text holds
    already would be a second key (parsing then fails and the fields are set one by one)."""
    body = F.trim(text, F.lit(" \t\r\n"))
    inner = F.substring(body, F.lit(2), F.length(body) - 2)
    has_ctx = text.contains('"eventn_ctx"')
    ctx = F.struct(
        header(context.EVENT_ID).alias("event_id"), header(context.USER_AGENT).alias("user_agent")
    )
    fields = F.struct(
        header(context.CLIENT_IP).alias("source_ip"),
        header(context.SOURCE).alias("api_key"),
        header(context.PROTOCOL).alias("src"),
        received_at().alias("_timestamp"),
        F.when(~has_ctx & (ctx["event_id"].isNotNull() | ctx["user_agent"].isNotNull()), ctx).alias(
            "eventn_ctx"
        ),
        F.when(~text.contains('"event_type"'), header(context.TYPE)).alias("event_type"),
    )
    added = F.to_json(fields)  # nulls are left out
    added_inner = F.substring(added, F.lit(2), F.length(added) - 2)
    parts = [
        F.when(F.trim(inner, F.lit(" \t\r\n")) != "", inner),
        F.when(added_inner != "", added_inner),
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
        ctx_done = done & ~text.contains('"eventn_ctx"')
    for path, name in FIELDS:
        finished = ctx_done if path[0] == "eventn_ctx" else done
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
