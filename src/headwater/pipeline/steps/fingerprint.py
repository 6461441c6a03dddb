"""The ``fingerprint`` enrichment: events whose chosen fields hash to a fingerprint seen within a
window (by their receive time) are dropped as duplicates, counted as skipped, across micro-batches
and restarts.

The fingerprint is 64 bits of the MD5 of the fields' JSON, and the event id is kept as 64 bits of
its MD5 (both made in the query). The store (``seen_store``: sorted segments in a folder, under
one lock) keeps each fingerprint's first event and its receive time; ``hw_seen(fingerprint, event
id, time)`` answers and teaches it once per vector of rows. An event is a duplicate only when the
fingerprint's first event is *another* event: a batch run again (learning, a replay, a restart
after a crash) finds its own events there and keeps them, so the answer is the same every time.
Two tasks of a batch take turns on the lock; the first to write a fingerprint keeps it.

The store is a folder: the executors must all reach it, as they do in local mode and on one
machine; on a cluster of machines, a shared filesystem that honours ``flock``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headwater.pipeline import sql
from headwater.pipeline.columns import pointer_parts
from headwater.pipeline.enrichment_config import Fingerprint
from headwater.pipeline.fields import Fields, as_json, subtree
from headwater.pipeline.steps import seen_store

FUNCTION = "hw_seen"
SETTINGS = "fingerprint"  # settings: {store, window_s}
EVENT_ID = ("eventn_ctx", "event_id")
TIMESTAMP = ("_timestamp",)


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
    return f"{_hash64(text)}, {_hash64(ident.sql)}, epoch({stamp.sql})"


def _hash64(text: str) -> str:
    return f"(md5_number({text}) >> 64)::UBIGINT"


def register(con: Any, settings: dict[str, Any]) -> None:
    from headwater.pipeline.steps.lookup import arrow_function

    store, window = settings["store"], float(settings["window_s"])
    arrow_function(
        con,
        FUNCTION,
        lambda fps, ids, ats: _seen(seen_store.at(store), fps, ids, ats, window),
        ["UBIGINT", "UBIGINT", "DOUBLE"],
        "BOOLEAN",
        side_effects=True,
    )


def _seen(
    store: seen_store.SeenStore, fps: pa.Array, ids: pa.Array, ats: pa.Array, window: float
) -> pa.Array:
    """The store's answer per row; a row missing any of the three takes no part (kept)."""
    whole = pc.and_(pc.and_(pc.is_valid(fps), pc.is_valid(ids)), pc.is_valid(ats))
    times = pc.if_else(whole, ats, np.nan).to_numpy(zero_copy_only=False)
    keys = fps.fill_null(0).to_numpy(zero_copy_only=False)
    idents = ids.fill_null(0).to_numpy(zero_copy_only=False)
    return pa.array(store.seen(keys, idents, times, window), pa.bool_())
