"""Python functions the shaping tests configure, as a user's module beside their config."""

from __future__ import annotations

from typing import Any

BROKEN = {"on": True}  # the tests "fix" enrich by turning this off


def enrich(event: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]] | None:
    name = event.get("event")
    if name == "boom" and BROKEN["on"]:
        raise ValueError("no boom")
    if name == "drop":
        return None
    if name == "fan":
        return [dict(event, part=i) for i in range(3)]
    event["touched"] = True
    return event


def with_context(event: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    return dict(event, seen_id=context["event_id"], seen_type=context["type"])


def not_an_event(event: dict[str, Any]) -> Any:
    return "text"


def fan_novel(event: dict[str, Any]) -> list[dict[str, Any]]:
    """Three events; with ``novel`` the third has a field the others never have."""
    parts = [{"event": event.get("event"), "part": i} for i in range(3)]
    if event.get("novel"):
        parts[2]["extra"] = {"deep": 1}
    return parts
