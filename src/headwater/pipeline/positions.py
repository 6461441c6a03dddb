"""A set of records by their place on the log (topic, partition, offset), kept as ranges of
offsets: what a delivering destination's tasks held back in one run of a micro-batch (rows the
plan could not describe whole yet) and deliver in the next, after the plan has learned them.

A destination that stages can discard what a run staged and run the batch again; one that
delivers cannot take back what it sent, so a batch planned again sends, in each run, only the
rows no earlier run sent (``headwater.pipeline.writer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: Spark's planning processes parse these, nothing more
    import numpy as np
    import pyarrow as pa


class Positions:
    def __init__(self) -> None:
        # (topic, partition) -> sorted, disjoint [start, end) ranges
        self._ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __len__(self) -> int:
        return sum(e - s for ranges in self._ranges.values() for s, e in ranges)

    def add(self, records: pa.Table) -> None:
        """Add the places of ``records`` (columns ``topic``, ``partition``, ``offset``)."""
        if not records.num_rows:
            return
        topics = records.column("topic").to_pylist()
        partitions = records.column("partition").to_pylist()
        offsets = records.column("offset").to_pylist()
        found: dict[tuple[str, int], list[int]] = {}
        for t, p, o in zip(topics, partitions, offsets, strict=True):
            found.setdefault((t, p), []).append(o)
        for where, values in found.items():
            ranges = self._ranges.get(where, [])
            ranges += [(o, o + 1) for o in values]
            self._ranges[where] = _merged(ranges)

    def merge(self, other: Positions) -> None:
        for where, ranges in other._ranges.items():
            self._ranges[where] = _merged(self._ranges.get(where, []) + ranges)

    def contains(self, records: pa.Table) -> np.ndarray:
        """Per row of ``records`` (``topic``, ``partition``, ``offset``): is it in the set."""
        import numpy as np

        n = records.num_rows
        out = np.zeros(n, dtype=bool)
        if not n or not self._ranges:
            return out
        topics = np.array(records.column("topic").to_pylist(), dtype=object)
        partitions = records.column("partition").to_numpy(zero_copy_only=False)
        offsets = records.column("offset").to_numpy(zero_copy_only=False)
        for (topic, partition), ranges in self._ranges.items():
            here = (topics == topic) & (partitions == partition)
            if not here.any():
                continue
            starts = np.array([s for s, _ in ranges], dtype=np.int64)
            ends = np.array([e for _, e in ranges], dtype=np.int64)
            at = np.searchsorted(starts, offsets, side="right") - 1
            inside = (at >= 0) & (offsets < ends[np.maximum(at, 0)])
            out |= here & inside
        return out

    def to_json(self) -> list[list[Any]]:
        return [[t, p, [list(r) for r in ranges]] for (t, p), ranges in self._ranges.items()]

    @classmethod
    def from_json(cls, data: list[list[Any]] | Mapping[str, Any]) -> Positions:
        out = cls()
        for t, p, ranges in data:  # type: ignore[misc]
            out._ranges[(str(t), int(p))] = [(int(s), int(e)) for s, e in ranges]
        return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
