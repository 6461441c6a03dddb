"""Python transform functions the tests of ``headwater.transport.functions`` configure by
import path (``tests.transport.functions_sample:<name>``)."""

from __future__ import annotations

from typing import Any

NOT_CALLABLE = 3


def drop_tests(message: dict[str, Any]) -> dict[str, Any] | None:
    """None (drop) for rows whose status is ``test``; the others unchanged."""
    if (message.get("data") or {}).get("status") == "test":
        return None
    return message


def shout(message: dict[str, Any]) -> dict[str, Any]:
    """The note in upper case, changed in place."""
    data = message.get("data")
    if data and isinstance(data.get("note"), str):
        data["note"] = data["note"].upper()
    return message


def to_archive(message: dict[str, Any]) -> dict[str, Any]:
    """The message moved to the namespace ``archive.<namespace>``."""
    return {**message, "namespace": "archive." + message["namespace"]}


def boom(message: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("boom on " + str(message.get("key")))


def not_a_message(message: dict[str, Any]) -> int:
    return 5


def not_json(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "data": {"bad": {1, 2}}}
