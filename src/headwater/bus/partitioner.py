"""Keyed partitioning by a stable hash: CRC-32 of the key modulo the partition count.

This is librdkafka's ``consistent`` partitioner, so a key lands on the same partition number on
both backends. Records without a key are spread round-robin, one run of records at a time.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence

from headwater.bus.errors import UnknownPartition
from headwater.bus.records import Message


def partition_for_key(key: bytes, partitions: int) -> int:
    return zlib.crc32(key) % partitions


class Partitioner:
    """Assigns a partition to every message of a batch."""

    def __init__(self) -> None:
        self._round_robin = itertools.count()

    def next_unkeyed(self, partitions: int) -> int:
        """The partition for the next run of records without a key."""
        return next(self._round_robin) % partitions

    def split(
        self, topic: str, partitions: int, messages: Sequence[Message]
    ) -> dict[int, list[int]]:
        """Group message indexes by partition, preserving the order within each partition."""
        unkeyed = self.next_unkeyed(partitions)
        n = len(messages)
        if partitions == 1 or all(m[1] is None and m[4] is None for m in messages):
            return {0 if partitions == 1 else unkeyed: list(range(n))} if n else {}
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(messages):
            p = m.partition
            if p is None:
                p = unkeyed if m.key is None else zlib.crc32(m.key) % partitions
            elif not 0 <= p < partitions:
                raise UnknownPartition(
                    f"topic {topic!r} has no partition {p} (it has {partitions})"
                )
            group = groups.get(p)
            if group is None:
                groups[p] = [i]
            else:
                group.append(i)
        return groups
