"""The fingerprint enrichment's store: per fingerprint, the first event seen with it (a 64-bit hash
of its id) and that event's receive time, shared by every task of a destination on one machine.

The store is a folder of immutable *segments*, each a file of entries sorted by fingerprint (in
three columns, mapped into memory), written once with a sequential write and renamed into place.
A call takes the folder's lock (``flock``), reads the segments other processes wrote since its
last call, answers its rows from them (newest segment first) and writes what the rows taught as
a new segment; then it merges the newest segments while the older of the last two is at most
twice the newer's size (so there are about log2(n) segments and each entry is rewritten about
log2(n) times), dropping entries more than two windows older than the newest receive time: a
batch whose times span up to a window answers the same when it runs again (learning, then
writing; after a crash), even after its own later rows moved the newest time on. Nothing is
written in place and nothing at random: the SQLite table this replaced spent ~20 µs an event on
random-key inserts.

A segment is named ``<newest>-<oldest>.seg`` by the sequence numbers it covers; a merged segment
covers its inputs', which it replaces. A process killed between writing a merged segment and
deleting its inputs leaves both; the next call deletes the covered ones. The files are not
fsynced: a process that dies loses nothing (the page cache keeps it), a machine that loses power
may forget recent fingerprints, so a repeat could land; never an event lost.
"""

from __future__ import annotations

import fcntl
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUFFIX = ".seg"
LOCK = "lock"
TMP = ".tmp"
KEEP_WINDOWS = 2  # entries are kept this many windows behind the newest receive time


@dataclass(frozen=True)
class Entries:
    """Entries sorted by fingerprint, one per fingerprint, as three columns (a segment's file
    holds them one after the other: n fingerprints, n ids, n times, 8 bytes each)."""

    fps: np.ndarray  # uint64
    ids: np.ndarray  # uint64
    ats: np.ndarray  # float64, epoch seconds

    def __len__(self) -> int:
        return len(self.fps)

    @property
    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (self.fps, self.ids, self.ats)

    def take(self, which: np.ndarray) -> Entries:
        return Entries(self.fps[which], self.ids[which], self.ats[which])

    def write(self, path: Path) -> None:
        with open(path, "wb") as out:
            for column in self.columns:
                out.write(np.ascontiguousarray(column).data)

    @classmethod
    def read(cls, path: Path) -> Entries:
        """The file's entries, mapped (only the pages searched are read)."""
        n = path.stat().st_size // 24
        if not n:
            return cls(*(np.zeros(0, dtype=t) for t in ("<u8", "<u8", "<f8")))
        mapped = np.memmap(path, dtype="<u8", mode="r", shape=(3 * n,))
        return cls(mapped[:n], mapped[n : 2 * n], mapped[2 * n :].view("<f8"))


@dataclass(frozen=True)
class _Segment:
    newest: int
    oldest: int
    entries: Entries

    @property
    def name(self) -> str:
        return _name(self.newest, self.oldest)


def _name(newest: int, oldest: int) -> str:
    return f"{newest:012d}-{oldest:012d}{SUFFIX}"


def _covers(a: _Segment, b: _Segment) -> bool:
    return a is not b and a.oldest <= b.oldest and b.newest <= a.newest


class SeenStore:
    """The segments of one folder, as this process last read them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.segments: dict[str, _Segment] = {}  # name -> segment
        self.thread_lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self.thread_lock, open(self.folder / LOCK, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _refresh(self) -> list[_Segment]:
        """The live segments, oldest first (those covered by a merge deleted)."""
        listed = os.listdir(self.folder)
        for dead in (n for n in listed if n.endswith(TMP)):  # writes are made under the lock
            (self.folder / dead).unlink(missing_ok=True)
        names = {n for n in listed if n.endswith(SUFFIX)}
        for gone in set(self.segments) - names:
            del self.segments[gone]
        for name in names - set(self.segments):
            newest, oldest = (int(p) for p in name[: -len(SUFFIX)].split("-"))
            self.segments[name] = _Segment(newest, oldest, Entries.read(self.folder / name))
        live = list(self.segments.values())
        for seg in live:
            if any(_covers(other, seg) for other in live):
                self._delete(seg)
        return sorted(self.segments.values(), key=lambda s: s.newest)

    def _delete(self, seg: _Segment) -> None:
        self.segments.pop(seg.name, None)
        (self.folder / seg.name).unlink(missing_ok=True)

    def _write(self, newest: int, oldest: int, entries: Entries) -> _Segment:
        """The segment written and renamed into place, mapped from its file (the page cache
        holds it, not this process)."""
        name = _name(newest, oldest)
        tmp = self.folder / f".{name}.{os.getpid()}{TMP}"
        entries.write(tmp)
        tmp.rename(self.folder / name)
        seg = _Segment(newest, oldest, Entries.read(self.folder / name))
        self.segments[name] = seg
        return seg

    def seen(self, fps: np.ndarray, ids: np.ndarray, ats: np.ndarray, window: float) -> np.ndarray:
        """Per row (fingerprint, id hash, receive time; rows with a NaN time take no part): its
        fingerprint's first event is another one, at or before it, within ``window``. The first
        row of a fingerprint not yet known becomes its first event; a row long after its
        fingerprint's first event (by more than the window) becomes the first one."""
        n = len(fps)
        out = np.zeros(n, dtype=bool)
        valid = ~np.isnan(ats)
        rows = np.flatnonzero(valid)
        if not len(rows):
            return out
        with self._locked():
            segments = self._refresh()
            keys = fps[rows]
            order = np.argsort(keys, kind="stable")
            ordered = keys[order]
            known, known_id, known_at = _lookup(segments, order, ordered)
            twin = ordered[1:] == ordered[:-1]  # next to its repeat in key order
            repeated = np.zeros(len(keys), dtype=bool)
            repeated[order[1:][twin]] = True
            repeated[order[:-1][twin]] = True
            simple = ~known & ~repeated  # the common case: new and alone in the call
            changed: dict[int, tuple[int, float]] = {}
            first: dict[int, tuple[int, float]] = {}
            for i in np.flatnonzero(~simple).tolist():  # in row order: the first row wins
                fp, ident, when = int(keys[i]), int(ids[rows[i]]), float(ats[rows[i]])
                prior = first.get(fp)
                if prior is None and known[i]:
                    prior = (int(known_id[i]), float(known_at[i]))
                if prior is None or when - prior[1] > window:
                    first[fp] = changed[fp] = (ident, when)
                    continue
                first[fp] = prior
                if prior[0] != ident:
                    out[rows[i]] = when >= prior[1]
            fresh = order[simple[order]]  # in key order
            taught = Entries(keys[fresh], ids[rows[fresh]], ats[rows[fresh]])
            if changed:
                more = Entries(
                    np.array(list(changed), dtype="<u8"),
                    np.array([v[0] for v in changed.values()], dtype="<u8"),
                    np.array([v[1] for v in changed.values()], dtype="<f8"),
                )
                pairs = zip(taught.columns, more.columns, strict=True)
                taught = Entries(*(np.concatenate(pair) for pair in pairs))
                taught = taught.take(np.argsort(taught.fps, kind="stable"))
            if len(taught):
                self._add(segments, taught, float(ats[rows].max()), window)
        return out

    def _add(self, segments: list[_Segment], entries: Entries, now: float, window: float) -> None:
        """Write ``entries`` as the newest segment, then merge while the last two are alike in
        size."""
        seq = (segments[-1].newest if segments else 0) + 1
        segments = [*segments, self._write(seq, seq, entries)]
        while len(segments) >= 2 and len(segments[-2].entries) <= 2 * len(segments[-1].entries):
            older, newer = segments[-2], segments[-1]
            merged = _merge(older.entries, newer.entries, now - KEEP_WINDOWS * window)
            # even empty: the newest sequence number stays on disk
            seg = self._write(newer.newest, older.oldest, merged)
            self._delete(older)
            self._delete(newer)
            segments = [*segments[:-2], seg]


def _lookup(
    segments: list[_Segment], order: np.ndarray, ordered: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key (``ordered``: the keys sorted, ``order`` their places), whether a segment has
    it, and the id and time there: newest segment first, so the first match is the current one;
    searched in key order, so each segment is read front to back."""
    n = len(order)
    known = np.zeros(n, dtype=bool)
    known_id = np.zeros(n, dtype="<u8")
    known_at = np.zeros(n, dtype="<f8")
    for seg in reversed(segments):
        todo = np.flatnonzero(~known[order])
        if not len(todo):
            break
        fps = seg.entries.fps
        at = np.searchsorted(fps, ordered[todo])
        at[at == len(fps)] = 0
        hit = fps[at] == ordered[todo]
        found, where = order[todo[hit]], at[hit]
        known[found] = True
        known_id[found] = seg.entries.ids[where]
        known_at[found] = seg.entries.ats[where]
    return known, known_id, known_at


def _merge(older: Entries, newer: Entries, oldest: float) -> Entries:
    """One sorted run of both, the newer entry kept for a fingerprint in both, those older than
    ``oldest`` dropped."""
    at = np.searchsorted(older.fps, newer.fps)
    inside = at < len(older)
    same = np.zeros(len(newer), dtype=bool)
    same[inside] = older.fps[at[inside]] == newer.fps[inside]
    if same.any():  # the older entry of a fingerprint in both goes
        keep = np.ones(len(older), dtype=bool)
        keep[at[same]] = False
        older = older.take(keep)
        at = at - (np.cumsum(same) - same)  # less those removed before each place
    both = Entries(
        np.insert(older.fps, at, newer.fps),
        np.insert(older.ids, at, newer.ids),
        np.insert(older.ats, at, newer.ats),
    )
    stale = both.ats < oldest
    return both.take(~stale) if stale.any() else both


@functools.cache
def at(folder: str) -> SeenStore:
    """This process's view of the store at ``folder`` (two views made by a race would still
    take turns: each opens the lock file itself)."""
    return SeenStore(Path(folder))


def forget() -> None:
    """Drop every view (as a restarted worker starts)."""
    at.cache_clear()
