"""Step 2, context enrichment: what the collector recorded in the headers goes into the event,
under the names Jitsu's pipeline uses (seed 002, "ContextEnrichment step"):

| field | from header | |
|---|---|---|
| ``source_ip`` | ``client-ip`` | the client's address (trusted proxies honoured) |
| ``_timestamp`` | ``received-at`` | UTC receive time, a TIMESTAMP (else the record's time) |
| ``api_key`` | ``source`` | the id of the source whose write key was used (never the key) |
| ``src`` | ``protocol`` | the intake: raccoon-ws, segment, jitsu, otlp, ... |
| ``eventn_ctx.event_id`` | ``event-id`` | the UUIDv7 given on receipt |
| ``eventn_ctx.user_agent`` | ``user-agent`` | the client's User-Agent |
| ``event_type`` | ``type`` | only when the event has no ``event_type`` of its own |

Context fields replace what a client sent under the same names: they are the server's facts.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from headwater.bus import context
from headwater.pipeline.columns import EVENT, header, json_path, with_event

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


def enrich_context(df: DataFrame) -> DataFrame:
    """Add the context fields to ``event`` (rows without an event pass through)."""
    for path, name in FIELDS:
        df = with_event(df, set_if(F.col(EVENT), path, header(name)))
    received = F.coalesce(F.try_to_timestamp(header(context.RECEIVED_AT)), F.col("timestamp"))
    df = with_event(df, set_if(F.col(EVENT), ("_timestamp",), received))
    event = F.col(EVENT)
    has_type = F.variant_get(event, json_path(("event_type",)), "variant").isNotNull()
    return with_event(
        df, F.when(has_type, event).otherwise(set_if(event, ("event_type",), header(context.TYPE)))
    )
