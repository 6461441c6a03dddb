"""Names of the record headers that carry an event's context.

The collector writes them; the pipeline reads them. The event's bytes travel untouched in the
record's value; everything headwater knows about how it arrived travels here. Values are UTF-8.
"""

from __future__ import annotations

TYPE = "type"  #: the event type (Raccoon ``Event.type``, the Segment call, the Jitsu type ...)
CONTENT_TYPE = "content-type"  #: the media type of the value (application/json, ...)
SOURCE = "source"  #: the id of the configured source (write key owner), or "raccoon"
REQUEST_ID = "request-id"  #: the client's request id (Raccoon req_guid) or one we made
EVENT_ID = "event-id"  #: a UUIDv7 given to each event on receipt
RECEIVED_AT = "received-at"  #: receive time, UTC, ISO 8601 with milliseconds
CLIENT_IP = "client-ip"  #: the client's address (trusted proxies honoured)
USER_AGENT = "user-agent"  #: the client's User-Agent, when it sent one
PROTOCOL = "protocol"  #: which intake took it: raccoon-ws, raccoon-rest, raccoon-grpc, segment,
#: jitsu, otlp

ALL = (
    TYPE,
    CONTENT_TYPE,
    SOURCE,
    REQUEST_ID,
    EVENT_ID,
    RECEIVED_AT,
    CLIENT_IP,
    USER_AGENT,
    PROTOCOL,
)
