"""Topic name rules shared by both backends (Kafka's rules, so topics move between them)."""

from __future__ import annotations

import re

from headwater.bus.errors import InvalidTopicName

MAX_TOPIC_NAME = 249
_VALID = re.compile(r"[A-Za-z0-9._-]+")


def check_topic_name(name: str) -> str:
    """Return ``name`` if it is a valid topic name, else raise ``InvalidTopicName``."""
    if not isinstance(name, str) or not name:
        raise InvalidTopicName("topic name must be a non-empty string")
    if len(name) > MAX_TOPIC_NAME:
        raise InvalidTopicName(
            f"topic name {name[:40]!r}... is {len(name)} characters; the limit is {MAX_TOPIC_NAME}"
        )
    if name in (".", ".."):
        raise InvalidTopicName(f"topic name {name!r} is reserved")
    if not _VALID.fullmatch(name):
        bad = sorted({c for c in name if not _VALID.fullmatch(c)})
        raise InvalidTopicName(
            f"topic name {name!r} has characters {''.join(bad)!r}; "
            "allowed are ASCII letters, digits, '.', '_' and '-'"
        )
    return name
