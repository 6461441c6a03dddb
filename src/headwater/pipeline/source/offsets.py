"""Offsets of the ``headwater`` source and the planning of a micro-batch, as pure functions.

An offset is a JSON-able dict ``{topic: {"partition": next_offset}}`` (partition numbers are
strings: Spark keeps offsets as JSON). A partition missing from a start offset (a topic or a
partition that appeared after the query started) starts at its low watermark, as Spark's Kafka
source does for new partitions.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

Offsets = dict[str, dict[str, int]]
Watermarks = Mapping[tuple[str, int], tuple[int, int]]

INTERNAL_PREFIX = "headwater-"


class Range(NamedTuple):
    """Records ``[start, end)`` of one partition."""

    topic: str
    partition: int
    start: int
    end: int


def select_topics(
    available: Iterable[str],
    names: list[str] | None,
    pattern: str | None,
    internal: Collection[str] = (),
) -> list[str]:
    """The topics a query reads: the named ones that exist, or those ``pattern`` matches in
    full. A pattern never matches internal topics (``headwater-...`` and those in ``internal``,
    such as the failed store's topic); a name does."""
    existing = sorted(set(available))
    if names is not None:
        wanted = set(names)
        return [t for t in existing if t in wanted]
    assert pattern is not None
    regex = re.compile(pattern)
    return [
        t
        for t in existing
        if regex.fullmatch(t) and not t.startswith(INTERNAL_PREFIX) and t not in internal
    ]


def to_offsets(positions: Mapping[tuple[str, int], int]) -> Offsets:
    out: Offsets = {}
    for (topic, partition), offset in sorted(positions.items()):
        out.setdefault(topic, {})[str(partition)] = int(offset)
    return out


def from_offsets(offsets: Mapping[str, Mapping[str, int]]) -> dict[tuple[str, int], int]:
    return {(t, int(p)): int(o) for t, parts in offsets.items() for p, o in parts.items()}


def resolve(
    marks: Watermarks, spec: str | Mapping[str, Mapping[str, int]], unnamed: str = "earliest"
) -> dict[tuple[str, int], int]:
    """Offsets from a spec: ``earliest``, ``latest`` or explicit offsets per partition
    (partitions not named take ``unnamed``; offsets are clamped into the log)."""
    if spec == "earliest":
        return {tp: low for tp, (low, _) in marks.items()}
    if spec == "latest":
        return {tp: high for tp, (_, high) in marks.items()}
    assert not isinstance(spec, str)
    given = from_offsets(spec)
    default = resolve(marks, unnamed)
    return {
        tp: min(max(given.get(tp, default[tp]), low), high) for tp, (low, high) in marks.items()
    }


def spread(limit: int, available: Mapping[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Share ``limit`` records fairly over partitions with ``available`` records each: every
    partition gets an equal share, and what a partition cannot use goes to the others."""
    share = {tp: 0 for tp in available}
    left = limit
    pending = sorted((n, tp) for tp, n in available.items() if n > 0)
    while pending and left > 0:
        each = max(1, left // len(pending))
        rest = []
        for n, tp in pending:
            if left <= 0:
                break
            take = min(n - share[tp], each, left)
            share[tp] += take
            left -= take
            if share[tp] < n:
                rest.append((n, tp))
        pending = rest
    return share


def plan_end(
    start: Mapping[tuple[str, int], int],
    marks: Watermarks,
    limit: int | None,
    target: Mapping[tuple[str, int], int] | None = None,
) -> dict[tuple[str, int], int]:
    """The end offset of the next micro-batch: every partition's high watermark (capped at
    ``target`` under Trigger.AvailableNow, where partitions the target lacks are not read), at
    most ``limit`` records in all. Never before ``start``."""
    first: dict[tuple[str, int], int] = {}
    highs: dict[tuple[str, int], int] = {}
    for tp, (low, high) in marks.items():
        begin = start.get(tp, low)
        if target is not None:
            high = min(high, target.get(tp, begin))
        first[tp] = max(begin, low)
        highs[tp] = max(high, begin)
    if limit is None:
        return highs
    available = {tp: max(highs[tp] - first[tp], 0) for tp in highs}
    share = spread(limit, available)
    return {tp: first[tp] + share[tp] if share[tp] else start.get(tp, first[tp]) for tp in highs}


def ranges(
    start: Mapping[tuple[str, int], int], end: Mapping[tuple[str, int], int], split: int
) -> list[Range]:
    """The records between two offsets, in ranges of at most ``split`` records (Spark tasks)."""
    out = []
    for (topic, partition), stop in sorted(end.items()):
        begin = start.get((topic, partition), 0)
        while begin < stop:
            out.append(Range(topic, partition, begin, min(stop, begin + split)))
            begin += split
    return out
