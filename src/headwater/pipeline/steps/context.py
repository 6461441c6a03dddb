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
| ``event_type`` | ``type`` | only when the event has no text ``event_type`` of its own |

Context fields replace what a client sent under the same names: they are the server's facts
(where a header is missing, the client's value stays, as text).
"""

from __future__ import annotations

from headwater.bus import context
from headwater.pipeline import sql
from headwater.pipeline.columns import header
from headwater.pipeline.fields import (
    TEXT,
    TIMESTAMP,
    Field,
    Fields,
    as_text,
    set_subtree,
    timestamp_of,
)
from headwater.pipeline.shape import STRING

CTX = "eventn_ctx"
STRINGS = frozenset({STRING})

FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("source_ip",), context.CLIENT_IP),
    (("api_key",), context.SOURCE),
    (("src",), context.PROTOCOL),
    ((CTX, "event_id"), context.EVENT_ID),
    ((CTX, "user_agent"), context.USER_AGENT),
)
HEADERS = (*(name for _, name in FIELDS), context.RECEIVED_AT, context.TYPE)


def received_at() -> str:
    """The receive time (the record's time when the header is missing or unreadable)."""
    return f'COALESCE({timestamp_of(sql.ident(header(context.RECEIVED_AT)))}, "timestamp")'


def enrich(fields: Fields) -> Fields:
    """``fields`` with the context fields set."""
    out = dict(fields)
    for path, name in FIELDS:
        value = sql.ident(header(name))
        own = out.get(path)
        if own is not None:
            value = f"COALESCE({value}, {as_text(own)})"
        out = set_subtree(out, path, {(): Field(path, value, TEXT, STRINGS)}, None)
    stamp = ("_timestamp",)
    out = set_subtree(out, stamp, {(): Field(stamp, received_at(), TIMESTAMP, STRINGS)}, None)
    kind = ("event_type",)
    own = out.get(kind)
    typed = sql.ident(header(context.TYPE))
    if own is None and not any(p[:1] == kind for p in out):
        out[kind] = Field(kind, typed, TEXT, STRINGS)
    elif own is not None and own.form == TEXT:
        out[kind] = Field(kind, f"COALESCE({own.sql}, {typed})", TEXT, STRINGS)
    return out
