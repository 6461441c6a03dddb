"""Committed offsets of writers (groups), persisted atomically at an interval and on close.

A hard kill loses at most the commits of the last interval, so a writer is redelivered at most
that window of records. The file is JSON: ``{"version": 1, "groups": {group: {topic:
{partition: offset}}}}``, replaced atomically (write, fdatasync, rename, fsync the directory).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from headwater.bus.errors import CorruptLog
from headwater.bus.records import TopicPartition

log = logging.getLogger(__name__)

Offsets = dict[str, dict[str, dict[int, int]]]


class GroupOffsets:
    def __init__(self, path: Path, flush_interval_s: float, *, writable: bool) -> None:
        self.path = path
        self.writable = writable
        self._lock = threading.Lock()
        self._offsets: Offsets = self._load()
        self._dirty = False
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if writable:
            self._thread = threading.Thread(
                target=self._run, args=(flush_interval_s,), name="headwater-offsets", daemon=True
            )
            self._thread.start()

    def _load(self) -> Offsets:
        try:
            raw = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise CorruptLog(f"group offsets file {self.path} is not valid JSON: {e}") from None
        return {
            group: {topic: {int(p): int(o) for p, o in parts.items()} for topic, parts in t.items()}
            for group, t in raw.get("groups", {}).items()
        }

    def reload(self) -> None:
        """Read-only: pick up what the writing process persisted since."""
        offsets = self._load()
        with self._lock:
            self._offsets = offsets

    def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        with self._lock:
            topics = self._offsets.setdefault(group, {})
            for (topic, partition), offset in offsets.items():
                topics.setdefault(topic, {})[partition] = offset
            self._dirty = True

    def committed(self, group: str, topics: Sequence[str] | None) -> dict[TopicPartition, int]:
        with self._lock:
            t = self._offsets.get(group, {})
            return {
                TopicPartition(topic, p): o
                for topic, parts in sorted(t.items())
                if topics is None or topic in topics
                for p, o in sorted(parts.items())
            }

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(self._offsets)

    def lowest(self, topic: str, partition: int) -> int | None:
        """The lowest offset any group that reads ``topic`` has committed for ``partition``
        (0 for a group that reads the topic but has not committed this partition)."""
        with self._lock:
            found = [
                parts.get(partition, 0)
                for t in self._offsets.values()
                if (parts := t.get(topic)) is not None
            ]
        return min(found) if found else None

    def flush(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            doc = {
                "version": 1,
                "groups": {
                    g: {t: {str(p): o for p, o in parts.items()} for t, parts in topics.items()}
                    for g, topics in self._offsets.items()
                },
            }
            self._dirty = False
        data = json.dumps(doc, sort_keys=True).encode()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _run(self, interval: float) -> None:
        while not self._closing.wait(interval):
            try:
                self.flush()
            except OSError as e:  # keep the commits in memory; the next round retries
                log.error("could not persist group offsets to %s: %s", self.path, e)
                with self._lock:
                    self._dirty = True

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
        if self.writable:
            self.flush()
