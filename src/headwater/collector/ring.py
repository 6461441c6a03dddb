"""Shared memory between an intake worker and the process that holds the log.

Each worker has one anonymous shared mapping, made by the main process before the fork, so both
see the same pages. The worker puts each encoded batch body in it and sends only where it is;
the log's writer then writes the body from the mapping (``writev``), so an event's bytes are
copied once into the mapping and once into the page cache, and never through the socket.

The worker owns the space: it takes a region per body and frees it when the append is answered
(the answer comes after the writer has written it). Regions are taken in order around the ring;
a body that does not fit (the ring is full of appends in flight, or the body is larger than the
ring) travels inline in its frame instead. Pages of the mapping stay resident once touched, so
the ring is small (``RING_BYTES``: it only needs to hold the appends in flight), and when it has
been empty for a while its pages are given back (``release_if_idle``).
"""

from __future__ import annotations

import mmap
from collections import deque

RING_BYTES = 4 << 20


def shared_mapping(size: int = RING_BYTES) -> mmap.mmap:
    """An anonymous mapping that a forked child shares with its parent."""
    return mmap.mmap(-1, size, flags=mmap.MAP_SHARED)


class Ring:
    """The worker's allocator over its mapping."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self.view = memoryview(mapping)
        self._touched = 0  # bytes written since the pages were last given back
        self.size = len(mapping)
        self._head = 0  # where the next region starts (counts up; position = head % size)
        self._tail = 0  # the start of the oldest region still in use
        self._regions: deque[list[int]] = deque()  # [start, end, freed] in order taken

    def put(self, body: bytes | memoryview) -> int | None:
        """Copy ``body`` into a free region; its position, or None when it does not fit."""
        at = self.take(len(body))
        if at is not None:
            self.view[at : at + len(body)] = body
        return at

    def take(self, n: int) -> int | None:
        """Take a free region of ``n`` bytes for the caller to fill (``view[at : at + n]``);
        its position, or None when it does not fit."""
        if not n or n > self.size:
            return None
        start = self._head
        at = start % self.size
        if at + n > self.size:  # no wrapping inside a body: skip the rest of the ring
            start += self.size - at
            at = 0
        if start + n - self._tail > self.size:
            return None
        self._touched += n
        self._regions.append([start, start + n, 0])
        self._head = start + n
        return at

    def free(self, at: int) -> None:
        """Give back the region at position ``at`` (any order); the ring reuses space once
        every region taken before it is free too."""
        for region in self._regions:
            if region[0] % self.size == at and not region[2]:
                region[2] = 1
                break
        while self._regions and self._regions[0][2]:
            self._tail = self._regions.popleft()[1]
        if not self._regions:
            self._tail = self._head

    def release_if_idle(self) -> bool:
        """Give the pages back (both processes' view of them) when nothing is in flight."""
        if self._regions or not self._touched:
            return False
        self._head = self._tail = 0
        self._touched = 0
        self.mapping.madvise(mmap.MADV_REMOVE)
        return True

    def close(self) -> None:
        self.view.release()
