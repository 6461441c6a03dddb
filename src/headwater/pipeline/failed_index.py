"""An in-memory index of the failed store, for pages that must answer at once with 100,000
failed events and more (the console): one row per record with its place on the store, its id,
destination, step, code and time, kept as NumPy columns. Only what was appended since the last
look is read (``refresh``), so a page costs its filter over the columns and the reads of the
events it shows, not a pass over the store.

Each id's latest record is the one shown (as ``FailedStore.events``): an id failed again hides
its earlier records. Memory: about 200 bytes per record (the ids and the small strings).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from headwater.pipeline.failed import (
    AT,
    CODE,
    DESTINATION,
    REASON,
    STEP,
    FailedEvent,
    FailedStore,
    event_at,
    read_range,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from headwater.bus import Bus

READ_CHUNK = 65_536  # records read at a time while catching up
_NAMES = (DESTINATION, STEP, CODE, AT)
CONTRACT = "contract"  # the contract an event broke (from its reason), "" for other failures
_BROKE = "contract "  # how a contract's failure reason starts: "contract signup/1-0-0: ..."


@dataclass(frozen=True)
class IndexPage:
    events: list[FailedEvent]
    next: str | None  # the cursor of the page after this one (None: this is the last)
    matching: int  # failed events that match the filters, in all


def time_key(iso: str) -> int:
    """An ISO time as the store writes it (``2026-11-26T10:00:00.000Z``) as an integer that
    sorts the same (its digits: 20261126100000000)."""
    digits = "".join(c for c in iso if c.isdigit())
    return int((digits + "0" * 17)[:17]) if digits else 0


class FailedIndex:
    def __init__(self, store: FailedStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}  # partition -> the next offset to index
        self._latest: dict[bytes, int] = {}  # id -> its latest row
        self._chunks: list[dict[str, np.ndarray]] = []
        self._columns: dict[str, np.ndarray] = _empty()

    def refresh(self) -> None:
        """Index what the store gained since the last look."""
        with self.store.open(read_only=True) as bus:
            self._catch_up(bus)

    def _catch_up(self, bus: Bus) -> None:
        with self._lock:
            if self.store.topic not in {t.name for t in bus.topics()}:
                return
            for p in range(bus.topic(self.store.topic).partitions):
                low, high = bus.watermarks(self.store.topic, p)
                start = max(low, self._next.get(p, low))
                while start < high:
                    end = min(high, start + READ_CHUNK)
                    for batch in read_range(bus, self.store.topic, p, start, end):
                        self._add(batch)
                    start = end
                self._next[p] = high
            self._merge()

    def _add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        n = batch.num_rows
        headers = batch.column("headers")
        parents = pc.list_parent_indices(headers).to_numpy(zero_copy_only=False)
        keys, values = headers.flatten().flatten()
        chunk: dict[str, np.ndarray] = {
            "partition": batch.column("partition").to_numpy(zero_copy_only=False).astype(np.int32),
            "offset": batch.column("offset").to_numpy(zero_copy_only=False).astype(np.int64),
        }
        for name in _NAMES:
            mask = pc.equal(keys, name).to_numpy(zero_copy_only=False)
            column = np.full(n, "", dtype=object)
            column[parents[mask]] = [
                v.decode("utf-8", "replace") for v in values.filter(mask).to_pylist()
            ]
            chunk[name] = column
        chunk["at"] = np.array([time_key(t) for t in chunk.pop(AT)], dtype=np.int64)
        chunk[CONTRACT] = _contracts(keys, values, parents, chunk[STEP], n)
        ids = batch.column("key").to_pylist()
        base = len(self._columns["offset"]) + sum(len(c["offset"]) for c in self._chunks)
        current = np.ones(n, dtype=bool)
        hidden: list[int] = []
        for i, event_id in enumerate(ids):
            if event_id is None:
                current[i] = False
                continue
            earlier = self._latest.get(event_id)
            if earlier is not None:
                if earlier >= base:
                    current[earlier - base] = False
                else:
                    hidden.append(earlier)
            self._latest[event_id] = base + i
        chunk["current"] = current
        chunk["hidden"] = np.array(hidden, dtype=np.int64)
        self._chunks.append(chunk)

    def _merge(self) -> None:
        if not self._chunks:
            return
        hidden = [c.pop("hidden") for c in self._chunks]
        columns = {
            k: np.concatenate([self._columns[k], *(c[k] for c in self._chunks)])
            for k in self._columns
        }
        for h in hidden:
            columns["current"][h] = False
        self._columns = columns
        self._chunks = []

    def page(
        self,
        destination: str | None = None,
        step: str | None = None,
        code: str | None = None,
        since: str | None = None,
        before: str | None = None,
        limit: int = 50,
        contract: str | None = None,
    ) -> IndexPage:
        """Up to ``limit`` failed events that match, newest first (by failed time, then place
        on the store), after the cursor ``before`` (a page's ``next``), and how many match."""
        with self.store.open(read_only=True) as bus:
            return self._page(bus, destination, step, code, since, before, limit, contract)

    def _page(
        self,
        bus: Bus,
        destination: str | None,
        step: str | None,
        code: str | None,
        since: str | None,
        before: str | None,
        limit: int,
        contract: str | None = None,
    ) -> IndexPage:
        self._catch_up(bus)
        c = self._columns
        mask = c["current"].copy()
        filters = ((DESTINATION, destination), (STEP, step), (CODE, code), (CONTRACT, contract))
        for name, value in filters:
            if value is not None:
                mask &= c[name] == value
        if since is not None:
            mask &= c["at"] >= time_key(since)
        matching = int(mask.sum())
        if before is not None:
            at, part, offset = _cursor(before)
            older = (c["at"] < at) | (
                (c["at"] == at)
                & ((c["partition"] < part) | ((c["partition"] == part) & (c["offset"] < offset)))
            )
            mask &= older
        rows = np.flatnonzero(mask)
        order = np.lexsort((c["offset"][rows], c["partition"][rows], c["at"][rows]))
        chosen = rows[order[::-1][: limit + 1]]
        shown = chosen[:limit]
        events = self._events(bus, shown)
        following = None
        if len(chosen) > limit:
            last = shown[-1]
            following = f"{c['at'][last]}:{c['partition'][last]}:{c['offset'][last]}"
        return IndexPage(events, following, matching)

    def get(self, event_id: str) -> FailedEvent | None:
        """The latest record of ``event_id`` (None: no such failed event)."""
        with self.store.open(read_only=True) as bus:
            self._catch_up(bus)
            row = self._latest.get(event_id.encode())
            return None if row is None else next(iter(self._events(bus, np.array([row]))), None)

    def count(self, since: str | None = None) -> int:
        """Failed events (each id once), failed at or after ``since`` when given."""
        self.refresh()
        mask = self._columns["current"]
        if since is not None:
            mask = mask & (self._columns["at"] >= time_key(since))
        return int(mask.sum())

    def _events(self, bus: Bus, rows: np.ndarray) -> list[FailedEvent]:
        """The events at ``rows``, in that order: one read per partition when they are close
        together (a page usually is), else one per event."""
        c = self._columns
        wanted = [(int(c["partition"][r]), int(c["offset"][r])) for r in rows]
        found: dict[tuple[int, int], FailedEvent] = {}
        by_partition: dict[int, list[int]] = {}
        for p, offset in wanted:
            by_partition.setdefault(p, []).append(offset)
        for p, offsets in by_partition.items():
            span = max(offsets) - min(offsets) + 1
            close = span <= 20 * len(offsets)
            ranges = [(min(offsets), max(offsets) + 1)] if close else [(o, o + 1) for o in offsets]
            for start, end in ranges:
                _collect(bus, self.store.topic, p, start, end, set(offsets), found)
        return [found[w] for w in wanted if w in found]


def _collect(
    bus: Bus,
    topic: str,
    partition: int,
    start: int,
    end: int,
    offsets: set[int],
    found: dict[tuple[int, int], FailedEvent],
) -> None:
    for batch in read_range(bus, topic, partition, start, end):
        for i, offset in enumerate(batch.column("offset").to_pylist()):
            if offset in offsets:
                event = event_at(batch, i)
                if event is not None:
                    found[(partition, offset)] = event


def _cursor(value: str) -> tuple[int, int, int]:
    from headwater.bus.errors import InvalidArgument

    try:
        at, part, offset = (int(x) for x in value.split(":"))
    except ValueError:
        raise InvalidArgument(f"{value!r} is not a page cursor of the failed events") from None
    return at, part, offset


def _contracts(
    keys: Any, values: Any, parents: np.ndarray, steps: np.ndarray, n: int
) -> np.ndarray:
    """Per record, the contract it broke: the label its reason starts with when the step is
    ``contract`` (only those reasons are read)."""
    import pyarrow.compute as pc

    column = np.full(n, "", dtype=object)
    broke = steps == "contract"
    if not broke.any():
        return column
    mask = pc.equal(keys, REASON).to_numpy(zero_copy_only=False)
    rows = parents[mask]
    wanted = broke[rows]
    reasons = values.filter(_narrowed(mask, wanted)).to_pylist()
    labels = []
    for r in reasons:
        text = r.decode("utf-8", "replace")
        labels.append(text[len(_BROKE) :].split(":", 1)[0] if text.startswith(_BROKE) else "")
    column[rows[wanted]] = labels
    return column


def _narrowed(mask: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``mask`` (over the headers) narrowed to the entries whose record is ``wanted`` (given per
    masked entry)."""
    out = mask.copy()
    out[np.flatnonzero(mask)[~wanted]] = False
    return out


def _empty() -> dict[str, Any]:
    return {
        "partition": np.zeros(0, dtype=np.int32),
        "offset": np.zeros(0, dtype=np.int64),
        DESTINATION: np.zeros(0, dtype=object),
        STEP: np.zeros(0, dtype=object),
        CODE: np.zeros(0, dtype=object),
        CONTRACT: np.zeros(0, dtype=object),
        "at": np.zeros(0, dtype=np.int64),
        "current": np.zeros(0, dtype=bool),
    }
