"""Jitsu's event APIs: the current one (``POST /api/s/{type}``) and the classic one
(``POST /api/v1/event?token=...``).

**Typed** (``/api/s/{type}``, and ``/api/s/s2s/{type}`` for server-to-server): the body is one
event in Segment's shape. The path names the type: ``page``, ``track``, ``identify``, ``group``,
``alias``, ``screen``, their one-letter forms (``p``, ``t``, ``i``, ``g``, ``a``, ``s``), or
``event`` (``e``), which takes the type from the event's ``"type"``. Jitsu accepts only the six
Segment types; headwater also accepts any other word (letters, digits, ``_ . -``, at most 64)
as a custom type. As in Jitsu, a track event needs an ``"event"`` name. The partition key is
``userId``, else ``anonymousId``, when present.

**Classic** (``/api/v1/event``): the body is one event object, an array of them, or
``{"template": {...}, "events": [...]}`` where every event gets the template's fields (the
template's value wins, as Jitsu's parser does). The type is the event's ``"event_type"``
(``"event"`` when absent); the key is ``user.id``, else ``user.anonymous_id`` (also under
``eventn_ctx`` for the compat format).

Events are stored as sent, re-encoded as compact JSON, except that the write key some SDKs put
in the body (``writeKey``; the classic SDK's ``api_key``) is taken out and returned in
``Intake.meta["write_key"]``: it is a credential, not event data.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from headwater.collector.config import LimitsConfig
from headwater.collector.errors import Rejected, bad_request, too_large
from headwater.collector.events import EventIn, Intake
from headwater.collector.protocols.body import dump_json, json_kind, parse_json, show_value

CONTENT_TYPE = "application/json"
SEGMENT_TYPES = frozenset({"alias", "group", "identify", "page", "screen", "track"})
_SHORT = {"p": "page", "i": "identify", "t": "track", "g": "group", "a": "alias", "s": "screen"}
_SHORT["e"] = "event"
_WORD = re.compile(r"[A-Za-z0-9_.-]{1,64}")

TYPED_SUCCESS_BODY = b'{"ok":true}'
"""What Jitsu answers an accepted ``/api/s/{type}`` call with (status 200)."""
CLASSIC_SUCCESS_BODY = b'{"status":"ok"}'
"""What Jitsu classic answers an accepted ``/api/v1/event`` call with (status 200)."""


def error_body(rejected: Rejected) -> bytes:
    """A refusal in Jitsu's shape (both APIs put the reason in ``message`` and ``error``)."""
    return orjson.dumps({"ok": False, "message": rejected.reason, "error": rejected.kind})


def decode_jitsu_typed(event_type: str, body: bytes, limits: LimitsConfig) -> Intake:
    """Decode ``POST /api/s/{event_type}``: one event."""
    path_type = _SHORT.get(event_type, event_type)
    if not _WORD.fullmatch(path_type):
        raise Rejected(
            f"/api/s/{event_type[:40]} does not name an event type: use page, track, identify, "
            "group, alias, screen, event, or a word of letters, digits, '_', '.', '-'",
            status=404,
            kind="not_found",
        )
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise bad_request(
            f"body must be one event as a JSON object, got {json_kind(doc)}", kind="bad_json"
        )
    etype = path_type
    if path_type == "event":
        etype = doc.get("type")
        if etype is None:
            raise bad_request(
                '/api/s/event takes the type from the event\'s "type", which is missing',
                kind="bad_event",
            )
        if not isinstance(etype, str) or not _WORD.fullmatch(etype):
            raise bad_request(
                f'"type" is {show_value(etype)}: it must be a word of letters, digits, '
                "'_', '.', '-' (at most 64)",
                kind="bad_event",
            )
    if etype == "track":
        name = doc.get("event")
        if not isinstance(name, str) or not name:
            raise bad_request(
                'a track event needs "event" (its name)'
                + ("" if name is None else f", got {show_value(name)}"),
                kind="bad_event",
            )
    meta: dict[str, str] = {}
    _take_key(doc, "writeKey", "", meta)
    key = _id(doc.get("userId")) or _id(doc.get("anonymousId"))
    return Intake([EventIn(etype, dump_json(doc, ""), CONTENT_TYPE, key)], None, meta)


def decode_jitsu_classic(body: bytes, limits: LimitsConfig) -> Intake:
    """Decode ``POST /api/v1/event``: an event, an array of events, or a template and events."""
    doc = parse_json(body)
    if isinstance(doc, dict):
        if "template" in doc and "events" in doc:
            items, prefix = _templated(doc), "events"
        else:
            items, prefix = [doc], ""
    elif isinstance(doc, list):
        if not doc:
            raise bad_request("body is an empty array: send at least one event", kind="empty_batch")
        items, prefix = doc, ""
    else:
        raise bad_request(
            f"body must be an event object or an array of them, got {json_kind(doc)}",
            kind="bad_json",
        )
    if len(items) > limits.max_batch_events:
        raise too_large(
            f"body has {len(items)} events, more than {limits.max_batch_events} "
            "(collector.limits.max_batch_events)"
        )
    meta: dict[str, str] = {}
    many = isinstance(doc, list) or bool(prefix)
    return Intake(
        [
            _classic_event(ev, f"{prefix}[{i}]: " if many else "", meta)
            for i, ev in enumerate(items)
        ],
        None,
        meta,
    )


def _templated(doc: dict[str, Any]) -> list[Any]:
    template, events = doc["template"], doc["events"]
    if not isinstance(template, dict):
        raise bad_request(
            f'"template" must be an object, got {json_kind(template)}', kind="bad_batch"
        )
    if not isinstance(events, list):
        raise bad_request(
            f'"events" must be an array of events, got {json_kind(events)}', kind="bad_batch"
        )
    if not events:
        raise bad_request('"events" is empty: send at least one event', kind="empty_batch")
    out: list[Any] = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise bad_request(
                f"events[{i}]: an event must be a JSON object, got {json_kind(ev)}",
                kind="bad_event",
            )
        out.append({**ev, **template})
    return out


def _classic_event(ev: Any, where: str, meta: dict[str, str]) -> EventIn:
    if not isinstance(ev, dict):
        raise bad_request(
            f"{where}an event must be a JSON object, got {json_kind(ev)}", kind="bad_event"
        )
    etype = ev.get("event_type")
    if etype is None or etype == "":
        etype = "event"
    elif not isinstance(etype, str):
        raise bad_request(
            f'{where}"event_type" must be a string, got {json_kind(etype)}', kind="bad_event"
        )
    _take_key(ev, "api_key", where, meta)
    return EventIn(etype, dump_json(ev, where), CONTENT_TYPE, _classic_key(ev))


def _classic_key(ev: dict[str, Any]) -> bytes | None:
    for holder in (ev, ev.get("eventn_ctx")):
        if isinstance(holder, dict):
            user = holder.get("user")
            if isinstance(user, dict):
                key = _id(user.get("id")) or _id(user.get("anonymous_id"))
                if key is not None:
                    return key
    return None


def _id(value: Any) -> bytes | None:
    if isinstance(value, str):
        return value.encode() if value else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return orjson.dumps(value)
    return None


def _take_key(ev: dict[str, Any], field: str, where: str, meta: dict[str, str]) -> None:
    """Move a write key out of the event into ``meta``."""
    if field not in ev:
        return
    key = ev.pop(field)
    if key is None or key == "":
        return
    if not isinstance(key, str):
        raise bad_request(
            f'{where}"{field}" must be a string, got {json_kind(key)}', kind="bad_event"
        )
    if meta.setdefault("write_key", key) != key:
        raise bad_request(
            f'{where}"{field}" differs from the one given earlier in the request',
            kind="bad_event",
        )
