"""Which topic an event goes to: a pattern over its type (``clickstream-{type}-log``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from headwater.bus.errors import InvalidTopicName
from headwater.bus.names import check_topic_name
from headwater.collector.errors import bad_request
from headwater.collector.events import EventIn, event_type

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class Router:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern.replace("%s", "{type}")
        self.topic = lru_cache(maxsize=4096)(self._topic)

    def _topic(self, event_type: str) -> str:
        if not event_type:
            raise bad_request("an event has an empty type", kind="bad_type")
        # Types are the client's words: characters a topic name cannot hold become "_".
        name = self.pattern.replace("{type}", _UNSAFE.sub("_", event_type))
        try:
            return check_topic_name(name)
        except InvalidTopicName as e:
            raise bad_request(
                f"event type {event_type[:80]!r}: {e.message}", kind="bad_type"
            ) from None

    def group(self, events: Sequence[EventIn]) -> dict[str, list[EventIn]]:
        """``events`` by topic, each topic's in their order. When they share one type (as a
        request's events mostly do) that is one lookup, not one per event."""
        types = list(map(event_type, events))
        if types and types.count(types[0]) == len(types):
            return {self.topic(types[0]): list(events)}
        out: dict[str, list[EventIn]] = {}
        topic = self.topic
        for t, e in zip(types, events, strict=True):
            out.setdefault(topic(t), []).append(e)
        return out
