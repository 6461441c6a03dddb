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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TRIMMED = "_hw_trimmed"  # the marker: the JSON paths whose values were cut
_TS_DIGITS = 19  # nanoseconds since the epoch, as DataSet wants them


class Event(NamedTuple):
    """One event to deliver (a tuple: a task makes one per event, so it must be cheap)."""

    data: bytes  # the event's JSON object
    ts_ns: int = 0  # its time (dataset's ts), 0: unknown
    source: Any = None  # where it came from (for the failed store)


class Pack:
    """Events of one session in log order, each encoded as its format lays an event out in a
    body (its *item*, ending with the format's separator), one after another: a run of a
    Spark task's rows, made without a Python object per event."""

    __slots__ = ("data", "ends", "sources")

    def __init__(self, data: bytes | memoryview, ends: np.ndarray, sources: Any = None) -> None:
        self.data = data
        self.ends = ends  # int64: where each event's item ends in ``data``
        self.sources = sources  # (rows, row numbers) they came from, for the failed store

    @property
    def count(self) -> int:
        return len(self.ends)

    @property
    def size(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def slice(self, start: int, stop: int) -> Pack:
        """Events ``start`` .. ``stop - 1``."""
        base = int(self.ends[start - 1]) if start else 0
        end = int(self.ends[stop - 1]) if stop > start else base
        sources = None
        if self.sources is not None:
            rows, numbers = self.sources
            sources = (rows, numbers[start:stop])
        return Pack(memoryview(self.data)[base:end], self.ends[start:stop] - base, sources)


def split(packs: Sequence[Pack], first: int) -> tuple[list[Pack], list[Pack]]:
    """``packs`` cut after their ``first`` events."""
    head: list[Pack] = []
    tail: list[Pack] = []
    left = first
    for pack in packs:
        if left >= pack.count:
            head.append(pack)
            left -= pack.count
        elif left > 0:
            head.append(pack.slice(0, left))
            tail.append(pack.slice(left, pack.count))
            left = 0
        else:
            tail.append(pack)
    return head, tail


class BodyFormat:
    """How one format lays events out; sizes are exact for the encoded body: a body is
    ``fixed(session)`` bytes plus its events' items."""

    def __init__(self, name: str, session_info: dict[str, str] | None = None) -> None:
        if name not in ("ndjson", "json", "dataset"):
            raise ValueError(f"unknown body format {name!r}")
        self.name = name
        self.session_info = session_info or {}

    def fixed(self, session: str) -> int:
        """Bytes of a body besides its items (the last item's separator is not sent)."""
        if self.name == "ndjson":
            return 0
        if self.name == "json":
            return 1  # "[" and "]", less the last ","
        return len(self._dataset_head(session)) + 1  # the head and "]}", less the last ","

    def cost(self, event: Event) -> int:
        """Bytes ``event`` adds to a body: its item."""
        return len(self.item(event))

    def item(self, event: Event) -> bytes:
        if self.name == "ndjson":
            return event.data + b"\n"
        if self.name == "json":
            return event.data + b","
        ts = str(event.ts_ns).zfill(_TS_DIGITS).encode()
        return b'{"ts":"' + ts + b'","attrs":' + event.data + b"},"

    def items(
        self, texts: pa.Array, ts_ns: pa.Array, memory_pool: pa.MemoryPool | None = None
    ) -> pa.Array:
        """Every event's item, in one pass (``texts``: the events' JSON, as text; ``ts_ns``:
        int64)."""
        if self.name == "ndjson":
            return pc.binary_join_element_wise(texts, "", "\n", memory_pool=memory_pool)
        if self.name == "json":
            return pc.binary_join_element_wise(texts, "", ",", memory_pool=memory_pool)
        ts = pc.utf8_lpad(pc.cast(pc.fill_null(ts_ns, 0), pa.string()), _TS_DIGITS, "0")
        parts = ('{"ts":"', ts, '","attrs":', texts, "},", "")
        return pc.binary_join_element_wise(*parts, memory_pool=memory_pool)

    def pack(self, events: Sequence[Event]) -> Pack:
        """A pack of single events (their ``source`` kept per event)."""
        items = [self.item(e) for e in events]
        ends = np.cumsum([len(i) for i in items], dtype=np.int64)
        return Pack(b"".join(items), ends, ("events", [e.source for e in events]))

    def encode(self, session: str, packs: Sequence[Pack]) -> bytes | bytearray:
        if self.name == "ndjson":
            return b"".join(p.data for p in packs)
        body = bytearray(b"[" if self.name == "json" else self._dataset_head(session))
        for p in packs:
            body += p.data
        if self.name == "json":
            body[-1:] = b"]"
        else:
            body[-1:] = b"]}"
        return body

    def _dataset_head(self, session: str) -> bytes:
        head = {"session": session, "sessionInfo": self.session_info}
        return json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"events":['


def trim(event: Event, room: int, fmt: BodyFormat) -> Event | None:
    """``event`` cut down until it costs at most ``room`` bytes in a body: its longest string
    values first, each to what is needed, with ``_hw_trimmed`` naming the cut paths. None when
    it cannot fit (not an object, or too large without its strings)."""
    if fmt.cost(event) <= room:
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
        if cut and fmt.cost(_with(event, doc, cut)) <= room:
            break  # it fits now
        size = fmt.cost(_with(event, doc, [*cut, "/".join(path)]))
        excess = size - room
        keep = max(0, len(value) - excess - 1)
        while True:  # escapes make encoded and raw lengths differ: shrink until it fits
            _set(doc, path, value[:keep])
            trimmed = _with(event, doc, [*cut, "/".join(path)])
            if fmt.cost(trimmed) <= room or keep == 0:
                break
            keep = max(0, keep - max(1, (fmt.cost(trimmed) - room)))
        cut.append("/".join(path))
    result = _with(event, doc, cut) if cut else event
    return result if fmt.cost(result) <= room else None


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
