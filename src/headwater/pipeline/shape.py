"""The shape of a destination's events, carried from batch to batch.

A ``Shape`` knows, for every leaf path of the events' JSON seen so far (before any step), which
kinds of value it held (``BOOL``, ``INT64``, ``FLOAT64``, ``STRING``, ``JSON`` for objects and
arrays kept whole) and whether its text was always an ISO 8601 date-time.

Each event's JSON text is parsed once against the shape (``headwater.pipeline.steps.decode``):
a leaf that only ever held text is read as text, every other leaf as its raw JSON text, whose
kind is then checked per event, so a value of a kind the shape does not know is noticed, never
converted silently. An event holding anything the shape does not know is *novel*; only novel
events are inferred (``infer_texts``, in Python, exactly), the shape widens (``merge``) and the
batch is planned again. A batch like the last one runs with no inference at all.

Pure Python: the driver plans with it, the Spark tasks infer with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import orjson

from headwater.destinations.types import ColumnType, promote

Path = tuple[str, ...]

BOOL, INT64, FLOAT64, STRING, JSON = "BOOL", "INT64", "FLOAT64", "STRING", "JSON"
KINDS = (BOOL, INT64, FLOAT64, STRING, JSON)

ISO_TIMESTAMP = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|z|[+-]\d{2}(:?\d{2})?)?$"
_ISO = re.compile(ISO_TIMESTAMP, re.ASCII)


@dataclass(frozen=True)
class Leaf:
    kinds: frozenset[str]
    timestamp: bool = False  # every STRING value seen was an ISO 8601 date-time

    def merge(self, other: Leaf) -> Leaf:
        kinds = self.kinds | other.kinds
        ts = (STRING not in self.kinds or self.timestamp) and (
            STRING not in other.kinds or other.timestamp
        )
        return Leaf(kinds, ts and STRING in kinds)

    @property
    def is_text(self) -> bool:
        """Only ever text: parsed as text (every other leaf as its raw JSON)."""
        return self.kinds == {STRING}

    @property
    def is_timestamp(self) -> bool:
        return self.kinds == {STRING} and self.timestamp

    @property
    def column_type(self) -> ColumnType:
        """The lattice type of every value the leaf held."""
        if JSON in self.kinds:
            return ColumnType.STRING
        if self.is_timestamp:
            return ColumnType.TIMESTAMP
        return lattice_type(self.kinds)


def lattice_type(kinds: Iterable[str]) -> ColumnType:
    """The lowest lattice type holding values of every kind (JSON is stored as text)."""
    types = [ColumnType.STRING if k == JSON else ColumnType(k) for k in sorted(kinds)]
    if not types:
        return ColumnType.STRING
    return reduce(promote, types[1:], types[0])


@dataclass
class Shape:
    leaves: dict[Path, Leaf] = field(default_factory=dict)

    def merge(self, found: Mapping[Path, Leaf]) -> bool:
        """Widen with what a batch's novel events held; True when anything changed. A path
        that is a leaf in one place and an object in another becomes one JSON leaf."""
        before = dict(self.leaves)
        for path, leaf in found.items():
            have = self.leaves.get(path)
            self.leaves[path] = leaf if have is None else have.merge(leaf)
        # a leaf that is also a parent: keep the parent as a JSON leaf, drop what is below it
        for path in sorted(self.leaves, key=len):
            if path not in self.leaves:
                continue
            below = [p for p in self.leaves if len(p) > len(path) and p[: len(path)] == path]
            if below:
                for p in below:
                    del self.leaves[p]
                self.leaves[path] = Leaf(self.leaves[path].kinds | {JSON})
        return self.leaves != before

    def kinds_of(self, path: Path) -> frozenset[str]:
        leaf = self.leaves.get(path)
        return leaf.kinds if leaf is not None else frozenset()

    def structure(self) -> dict[str, Any]:
        """The ``json_transform`` structure the events are parsed with: text leaves as
        ``VARCHAR``, every other leaf as ``JSON`` (its raw JSON text), objects nested."""
        tree: dict[str, Any] = {}
        for path, leaf in self.leaves.items():
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = "VARCHAR" if leaf.is_text else "JSON"
        return tree

    def objects(self) -> list[Path]:
        """Every object path above a leaf (each counted once)."""
        out: set[Path] = set()
        for path in self.leaves:
            out.update(path[:i] for i in range(1, len(path)))
        return sorted(out)


# -- the slow path: what novel events hold ------------------------------------------------------
def infer_texts(texts: Iterable[str | bytes]) -> dict[Path, Leaf]:
    """The leaves of the JSON objects among ``texts`` (others are skipped), inferred exactly:
    per path the kinds of its non-null values, and whether its text was always a date-time."""
    kinds: dict[Path, set[str]] = {}
    iso: dict[Path, bool] = {}
    for text in texts:
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict):
            _walk(value, (), kinds, iso)
    return {p: Leaf(frozenset(k), iso.get(p, False) and STRING in k) for p, k in kinds.items()}


def _walk(obj: dict, prefix: Path, kinds: dict[Path, set[str]], iso: dict[Path, bool]) -> None:
    for key, value in obj.items():
        path = (*prefix, key)
        if value is None:
            continue
        if isinstance(value, dict) and value:
            _walk(value, path, kinds, iso)
            continue
        if isinstance(value, dict | list):
            kind = JSON
        elif isinstance(value, bool):
            kind = BOOL
        elif isinstance(value, int):
            kind = INT64 if -(1 << 63) <= value < (1 << 63) else FLOAT64
        elif isinstance(value, float):
            kind = FLOAT64
        else:
            kind = STRING
            iso[path] = iso.get(path, True) and _ISO.match(value) is not None
        kinds.setdefault(path, set()).add(kind)
