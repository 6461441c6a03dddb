"""The ``fingerprint`` enrichment: events whose chosen fields hash to a fingerprint seen within a
window (by their receive time) are dropped as duplicates, counted as skipped, across micro-batches
and restarts.

The fingerprint is the MD5 of the fields' JSON (in the query). A SQLite file keeps, per
fingerprint, the event id and receive time of its first event; ``hw_seen(fingerprint, event id,
time)`` looks at and updates it in one transaction per vector of rows. An event is a duplicate
only when the fingerprint's first event is *another* event: a batch run again (learning, a
replay, a restart after a crash) finds its own events there and keeps them, so the answer is the
same every time. Two tasks of a batch write the file at once (WAL, a busy timeout); the first to
commit a fingerprint keeps it. Entries older than the window are pruned now and then.

The store is a file: the executors must all reach it, as they do in local mode and on one
machine; on a cluster of machines, a shared filesystem that honours SQLite's locks.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa

from headwater.pipeline import sql
from headwater.pipeline.columns import pointer_parts
from headwater.pipeline.enrichment_config import Fingerprint
from headwater.pipeline.fields import Fields, as_json, subtree

FUNCTION = "hw_seen"
SETTINGS = "fingerprint"  # settings: {store, window_s}
EVENT_ID = ("eventn_ctx", "event_id")
TIMESTAMP = ("_timestamp",)
PRUNE_EVERY = 256  # calls between prunings of old entries
BUSY_MS = 30_000
CACHE_KB = 32_768  # pages of the table kept in memory: inserts land at random keys
CHECKPOINT_PAGES = 10_000  # WAL pages between checkpoints (SQLite's default: 1,000)


def argument(fields: Fields, rule: Fingerprint) -> str | None:
    """SQL of ``hw_seen``'s arguments: the fingerprint, the event id, the receive time (epoch
    seconds); None when no event has any of the fields."""
    parts = []
    for pointer in rule.fields:
        below = subtree(fields, pointer_parts(pointer))
        for rest in sorted(below):
            parts.append(f"COALESCE({as_json(below[rest])}, 'null')")
    ident, stamp = fields.get(EVENT_ID), fields.get(TIMESTAMP)
    if not parts or ident is None or stamp is None:
        return None
    text = f"concat_ws({sql.lit(chr(31))}, {', '.join(parts)})"
    return f"md5({text}), {ident.sql}, epoch({stamp.sql})"


def register(con: Any, settings: dict[str, Any]) -> None:
    from headwater.pipeline.steps.lookup import arrow_function

    store, window = settings["store"], float(settings["window_s"])
    arrow_function(
        con,
        FUNCTION,
        lambda fps, ids, ats: _Store.at(store).seen(fps, ids, ats, window),
        ["VARCHAR", "VARCHAR", "DOUBLE"],
        "BOOLEAN",
        side_effects=True,
    )


class _Store:
    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.con = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=NORMAL")
        self.con.execute(f"PRAGMA cache_size=-{CACHE_KB}")
        self.con.execute(f"PRAGMA wal_autocheckpoint={CHECKPOINT_PAGES}")
        self.con.execute(
            "CREATE TABLE IF NOT EXISTS seen (fp TEXT PRIMARY KEY, event_id TEXT, at REAL) "
            "WITHOUT ROWID"
        )
        self.lock = threading.Lock()
        self.calls = 0

    @staticmethod
    @functools.cache
    def at(path: str) -> _Store:
        return _Store(path)

    def seen(self, fps: pa.Array, ids: pa.Array, ats: pa.Array, window: float) -> pa.Array:
        """Per row: its fingerprint's first event is another one, within ``window``.

        One transaction: every row's fingerprint inserted unless known (SQLite's own loop; the
        first row of a vector wins among its repeats), the first events read back, and the
        entries older than the window given to the row that comes after it."""
        rows = list(zip(fps.to_pylist(), ids.to_pylist(), ats.to_pylist(), strict=True))
        full = [r for r in rows if None not in r]
        with self.lock:
            cur = self.con.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                cur.executemany(
                    "INSERT OR IGNORE INTO seen (fp, event_id, at) VALUES (?, ?, ?)", full
                )
                first: dict[str, tuple[str, float]] = {}
                wanted = list({fp for fp, _, _ in full})
                for start in range(0, len(wanted), 900):
                    chunk = wanted[start : start + 900]
                    marks = ",".join("?" * len(chunk))
                    query = f"SELECT fp, event_id, at FROM seen WHERE fp IN ({marks})"
                    first.update((fp, (i, a)) for fp, i, a in cur.execute(query, chunk))
                out: list[bool] = []
                stale: list[tuple[str, float, str]] = []
                for fp, ident, at in rows:
                    known = first.get(fp) if fp is not None and ident is not None else None
                    if known is None or at is None or known[0] == ident:
                        out.append(False)
                    elif at - known[1] > window:  # long after: this event is the first now
                        first[fp] = (ident, at)
                        stale.append((ident, at, fp))
                        out.append(False)
                    else:
                        out.append(at >= known[1])
                cur.executemany("UPDATE seen SET event_id = ?, at = ? WHERE fp = ?", stale)
                self.calls += 1
                newest = max((a for _, _, a in full), default=None)
                if self.calls % PRUNE_EVERY == 0 and newest is not None:
                    cur.execute("DELETE FROM seen WHERE at < ?", (newest - window,))
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        return pa.array(out, pa.bool_())
