"""Step 2, context enrichment: what the collector recorded in the headers goes into the event,
under the names Jitsu's pipeline uses (seed 002, "ContextEnrichment step"):

| field | from header | |
|---|---|---|
| ``source_ip`` | ``client-ip`` | the client's address (trusted proxies honoured) |
| ``_timestamp`` | ``received-at`` | UTC receive time, a timestamp (else the record's time) |
| ``api_key`` | ``source`` | the id of the source whose write key was used (never the key) |
| ``src`` | ``protocol`` | the intake: raccoon-ws, segment, jitsu, otlp, ... |
| ``eventn_ctx.event_id`` | ``event-id`` | the UUIDv7 given on receipt |
| ``eventn_ctx.user_agent`` | ``user-agent`` | the client's User-Agent |
| ``event_type`` | ``type`` | only when the event has no ``event_type`` of its own |

Context fields replace what a client sent under the same names: they are the server's facts.
The event is a struct of a known type, so each field is one native ``withField``.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructType

from headwater.bus import context
from headwater.pipeline.columns import EVENT, header, with_event
from headwater.pipeline.structs import nulls, type_at

CTX = "eventn_ctx"

FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("source_ip",), context.CLIENT_IP),
    (("api_key",), context.SOURCE),
    (("src",), context.PROTOCOL),
    ((CTX, "event_id"), context.EVENT_ID),
    ((CTX, "user_agent"), context.USER_AGENT),
)


def received_at() -> Column:
    """The receive time (the record's time when the header is missing or unreadable)."""
    return F.coalesce(F.try_to_timestamp(header(context.RECEIVED_AT)), F.col("timestamp"))


def _keep_or(current: Column, value: Column) -> Column:
    """``value``, or what the event had where the header is missing."""
    return F.coalesce(value, current)


def enrich_context(df: DataFrame) -> DataFrame:
    """Add the context fields to ``event`` (rows without an event pass through)."""
    struct = df.schema[EVENT].dataType
    assert isinstance(struct, StructType)
    event = F.col(EVENT)
    # top-level text fields: the header's value, else what the client sent (as text)
    for path, name in FIELDS:
        if path[0] == CTX:
            continue
        have = type_at(struct, path)
        value = header(name)
        if have is not None:
            value = _keep_or(event.getField(path[0]).cast("string"), value)
        event = event.withField(path[0], value)
    event = event.withField("_timestamp", received_at())
    # eventn_ctx: an object of the client's keeps its other fields
    ctx_type = type_at(struct, (CTX,))
    ctx_values = {path[1]: header(name) for path, name in FIELDS if path[0] == CTX}
    if isinstance(ctx_type, StructType):
        ctx = F.coalesce(event.getField(CTX), nulls(ctx_type))  # the client's object, or one
        for key, value in ctx_values.items():
            if key in ctx_type.names:
                value = _keep_or(ctx.getField(key).cast("string"), value)
            ctx = ctx.withField(key, value)
        event = event.withField(CTX, ctx)
    else:
        event = event.withField(CTX, F.struct(*[v.alias(k) for k, v in ctx_values.items()]))
    # event_type: the event's own, else the header's
    own = type_at(struct, ("event_type",))
    if own is None:
        event = event.withField("event_type", header(context.TYPE))
    elif isinstance(own, StringType):
        event = event.withField(
            "event_type", F.coalesce(event.getField("event_type"), header(context.TYPE))
        )
    return with_event(df, event)
