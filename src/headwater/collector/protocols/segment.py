"""The Segment HTTP Tracking API, as analytics-python, analytics.js and the RudderStack SDKs
send it.

Calls: ``POST /v1/batch`` (also ``/v1/import``, and analytics.js's ``/v1/b``) carries
``{"batch": [event, ...], "sentAt", "context"?, "integrations"?, "writeKey"?}``;
``POST /v1/<type>`` (also analytics.js's one-letter ``/v1/t``, ``/v1/p``...) carries one event.
Each event becomes one ``EventIn``: its Segment type, the event as compact JSON, and its
``userId`` (else ``anonymousId``) as the partition key.

What is stored is the event the client sent, re-encoded compactly (a batch has to be split),
with two documented exceptions:

- Batch-level ``context`` and ``integrations`` are merged into every event of the batch, the
  event's own keys winning (Segment: "the same as context for other calls, but it will be
  merged with any context inside each of the items in the batch"). A batch without them, as
  analytics-python sends, leaves its events untouched.
- ``writeKey`` is taken out of the events (analytics.js puts it in each one): it is the
  request's credential, not event data, and keys are never stored in the clear. It is
  returned in ``Intake.meta["write_key"]`` for the server to authenticate with.

The batch's ``sentAt`` is not copied into the events; it is returned in
``Intake.meta["sent_at"]`` so the server can pass it on as a header (clock-skew correction).

Validation follows Segment's documented rules, each refusal naming the event
(``batch[3]: ...``): the body is a JSON object; ``batch`` a non-empty array of objects; every
``type`` one of alias, group, identify, page, screen, track; every event has a ``userId`` or an
``anonymousId``; track has an ``event`` name, group a ``groupId``, alias a ``previousId``; at
most ``collector.limits.max_batch_events`` events. One bad event refuses the whole request:
nothing is partially published.
"""

from __future__ import annotations

from typing import Any

import orjson

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected, bad_request, too_large
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols.body import dump_json, json_kind, parse_json, show_value

CONTENT_TYPE = "application/json"
TYPES = frozenset({"alias", "group", "identify", "page", "screen", "track"})
_TYPE_LIST = ", ".join(sorted(TYPES))
_KINDS = {
    **{t: t for t in TYPES},
    **{t[0]: t for t in TYPES},  # analytics.js posts to /v1/t, /v1/p, /v1/i, /v1/g, /v1/a, /v1/s
    "batch": "batch",
    "b": "batch",
    "import": "batch",
}
_REQUIRED = {"track": "event", "group": "groupId", "alias": "previousId"}
_WHAT = {"event": "its name", "groupId": "the group's id", "previousId": "the user's old id"}

SUCCESS_BODY = b'{"success":true}'
"""What Segment answers an accepted call with (status 200)."""


def error_body(rejected: Rejected) -> bytes:
    """A refusal as Segment SDKs read it: analytics-python logs ``code`` and ``message``."""
    return orjson.dumps({"success": False, "code": rejected.kind, "message": rejected.reason})


def decode_segment(kind: str, body: bytes, limits: LimitsConfig) -> Intake:
    """Decode a Segment call: ``kind`` is the last path segment (``batch``, ``track``...)."""
    call = _KINDS.get(kind)
    if call is None:
        raise Rejected(
            f"/v1/{kind[:40]} is not a Segment call (use batch or one of {_TYPE_LIST})",
            status=404,
            kind="not_found",
        )
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise bad_request(f"body must be a JSON object, got {json_kind(doc)}", kind="bad_json")
    meta: dict[str, str] = {}
    if call == "batch":
        events = _batch(doc, limits, meta)
    else:
        events = [_event(doc, call, "", None, None, meta)]
    return Intake(events, None, meta)


def _batch(doc: dict[str, Any], limits: LimitsConfig, meta: dict[str, str]) -> list[EventIn]:
    batch = doc.get("batch")
    if batch is None:
        raise bad_request('body has no "batch" array of events', kind="bad_batch")
    if not isinstance(batch, list):
        raise bad_request(
            f'"batch" must be an array of events, got {json_kind(batch)}', kind="bad_batch"
        )
    if not batch:
        raise bad_request('"batch" is empty: send at least one event', kind="empty_batch")
    if len(batch) > limits.max_batch_events:
        raise too_large(
            f'"batch" has {len(batch)} events, more than {limits.max_batch_events} '
            "(collector.limits.max_batch_events)"
        )
    _take_write_key(doc, "", meta)
    sent_at = doc.get("sentAt")
    if sent_at is not None:
        if not isinstance(sent_at, str) or len(sent_at) > 64:
            raise bad_request(
                f'"sentAt" must be an ISO-8601 time string, got {show_value(sent_at)}',
                kind="bad_batch",
            )
        meta["sent_at"] = sent_at
    context = _shared(doc, "context")
    integrations = _shared(doc, "integrations")
    return [
        _event(e, None, f"batch[{i}]: ", context, integrations, meta) for i, e in enumerate(batch)
    ]


def _shared(doc: dict[str, Any], field: str) -> dict[str, Any] | None:
    value = doc.get(field)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f'"{field}" must be an object, got {json_kind(value)}', kind="bad_batch")
    return value or None


def _event(
    ev: Any,
    call: str | None,
    where: str,
    context: dict[str, Any] | None,
    integrations: dict[str, Any] | None,
    meta: dict[str, str],
) -> EventIn:
    if not isinstance(ev, dict):
        raise bad_request(
            f"{where}an event must be a JSON object, got {json_kind(ev)}", kind="bad_event"
        )
    etype = ev.get("type")
    if call is not None:  # /v1/<type>: the path names the type
        if etype is None:
            etype = call
        elif etype != call:
            raise bad_request(
                f'"type" is {show_value(etype)} but the call is /v1/{call}', kind="bad_event"
            )
    elif not isinstance(etype, str) or etype not in TYPES:
        if etype is None:
            raise bad_request(f'{where}"type" is missing (one of {_TYPE_LIST})', kind="bad_event")
        raise bad_request(
            f'{where}"type" is {show_value(etype)}, not one of {_TYPE_LIST}', kind="bad_event"
        )
    key = _identity(ev, "userId", where)
    if key is None:
        key = _identity(ev, "anonymousId", where)
        if key is None:
            raise bad_request(
                f'{where}{_a(etype)} call needs a "userId" or an "anonymousId"', kind="bad_event"
            )
    required = _REQUIRED.get(etype)
    if required is not None:
        value = ev.get(required)
        if not _present(value, required == "event"):
            raise bad_request(
                f'{where}{_a(etype)} call needs "{required}" ({_WHAT[required]})'
                + ("" if value is None else f", got {show_value(value)}"),
                kind="bad_event",
            )
    if "writeKey" in ev:
        _take_write_key(ev, where, meta)
        del ev["writeKey"]
    if context is not None:
        ev["context"] = _merged(ev.get("context"), context, where, "context")
    if integrations is not None:
        ev["integrations"] = _merged(ev.get("integrations"), integrations, where, "integrations")
    return EventIn(etype, dump_json(ev, where), CONTENT_TYPE, key)


def _identity(ev: dict[str, Any], field: str, where: str) -> bytes | None:
    """The id in ``field`` as partition-key bytes; None when absent or empty."""
    value = ev.get(field)
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode() if value else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return orjson.dumps(value)  # analytics-python accepts numeric ids
    raise bad_request(
        f'{where}"{field}" must be a string or a number, got {json_kind(value)}', kind="bad_event"
    )


def _present(value: Any, string_only: bool) -> bool:
    if isinstance(value, str):
        return bool(value)
    if string_only:
        return False
    return isinstance(value, int | float) and not isinstance(value, bool)


def _merged(own: Any, shared: dict[str, Any], where: str, field: str) -> dict[str, Any]:
    if own is None:
        return shared
    if not isinstance(own, dict):
        raise bad_request(
            f'{where}"{field}" must be an object, got {json_kind(own)}', kind="bad_event"
        )
    return {**shared, **own}


def _take_write_key(doc: dict[str, Any], where: str, meta: dict[str, str]) -> None:
    key = doc.get("writeKey")
    if key is None:
        return
    if not isinstance(key, str):
        raise bad_request(
            f'{where}"writeKey" must be a string, got {json_kind(key)}', kind="bad_event"
        )
    seen = meta.setdefault("write_key", key)
    if seen != key:
        raise bad_request(
            f'{where}"writeKey" differs from the one given earlier in the request',
            kind="bad_event",
        )


def _a(call: str) -> str:
    return ("an " if call[0] in "aeiou" else "a ") + call
