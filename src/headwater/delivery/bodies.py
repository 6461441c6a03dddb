"""Request bodies of the ``http`` destination: how a batch of events (each already JSON) is
encoded, how much each event adds to a body (so a batch is cut before it passes
``max_batch_bytes``), and how an event too large for any body is trimmed (seed 001, "Internal
Batching": attribute values cut, the longest first) with a marker field naming what was cut.

Formats: ``ndjson`` (one event per line), ``json`` (an array), ``dataset`` (DataSet's addEvents
body: ``{"session", "sessionInfo", "events": [{"ts", "attrs"}]}``, ``ts`` in nanoseconds as
text).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

TRIMMED = "_hw_trimmed"  # the marker: the JSON paths whose values were cut
_TS_DIGITS = 19  # nanoseconds since the epoch, as DataSet wants them


class Event(NamedTuple):
    """One event to deliver (a tuple: a task makes one per event, so it must be cheap)."""

    data: bytes  # the event's JSON object
    ts_ns: int = 0  # its time (dataset's ts), 0: unknown
    source: Any = None  # where it came from (for the failed store)


class BodyFormat:
    """How one format lays events out; sizes are exact for the encoded body."""

    def __init__(self, name: str, session_info: dict[str, str] | None = None) -> None:
        if name not in ("ndjson", "json", "dataset"):
            raise ValueError(f"unknown body format {name!r}")
        self.name = name
        self.session_info = session_info or {}

    def fixed(self, session: str) -> int:
        """Bytes of a body with no event."""
        if self.name == "ndjson":
            return 0
        if self.name == "json":
            return 2
        return len(self._dataset_head(session)) + 2

    def cost(self, event: Event, first: bool = False) -> int:
        """Bytes ``event`` adds to a body (with its separator unless it is the ``first``)."""
        n = len(event.data)
        if self.name == "ndjson":
            return n + 1
        separator = 0 if first else 1
        if self.name == "json":
            return n + separator
        return n + separator + len('{"ts":"","attrs":}') + _TS_DIGITS

    def encode(self, session: str, events: Sequence[Event]) -> bytes:
        if self.name == "ndjson":
            return b"".join(e.data + b"\n" for e in events)
        if self.name == "json":
            return b"[" + b",".join(e.data for e in events) + b"]"
        items = b",".join(
            b'{"ts":"' + str(e.ts_ns).zfill(_TS_DIGITS).encode() + b'","attrs":' + e.data + b"}"
            for e in events
        )
        return self._dataset_head(session) + items + b"]}"

    def _dataset_head(self, session: str) -> bytes:
        head = {"session": session, "sessionInfo": self.session_info}
        return json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"events":['


def trim(event: Event, room: int, fmt: BodyFormat) -> Event | None:
    """``event`` cut down until it costs at most ``room`` bytes in a body: its longest string
    values first, each to what is needed, with ``_hw_trimmed`` naming the cut paths. None when
    it cannot fit (not an object, or too large without its strings)."""
    if fmt.cost(event, first=True) <= room:
        return event
    try:
        doc = json.loads(event.data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    leaves = sorted(_strings(doc, ()), key=lambda leaf: -len(leaf[1]))
    cut: list[str] = []
    for path, value in leaves:
        if cut and fmt.cost(_with(event, doc, cut), first=True) <= room:
            break  # it fits now
        size = fmt.cost(_with(event, doc, [*cut, "/".join(path)]), first=True)
        excess = size - room
        keep = max(0, len(value) - excess - 1)
        while True:  # escapes make encoded and raw lengths differ: shrink until it fits
            _set(doc, path, value[:keep])
            trimmed = _with(event, doc, [*cut, "/".join(path)])
            if fmt.cost(trimmed, first=True) <= room or keep == 0:
                break
            keep = max(0, keep - max(1, (fmt.cost(trimmed, first=True) - room)))
        cut.append("/".join(path))
    result = _with(event, doc, cut) if cut else event
    return result if fmt.cost(result, first=True) <= room else None


def _strings(node: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    out: list[tuple[tuple[str, ...], str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _strings(v, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _strings(v, (*path, str(i)))
    elif isinstance(node, str) and path:
        out.append((path, node))
    return out


def _set(doc: Any, path: tuple[str, ...], value: str) -> None:
    node = doc
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value


def _with(event: Event, doc: dict[str, Any], cut: list[str]) -> Event:
    marked = {**doc, TRIMMED: ["/" + p for p in cut]} if cut else doc
    data = json.dumps(marked, separators=(",", ":"), ensure_ascii=False).encode()
    return event._replace(data=data)
