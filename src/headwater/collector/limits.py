"""Connection limits: how many WebSocket connections in total and per identity (and group)."""

from __future__ import annotations

from collections import Counter

from headwater.collector.errors import Code, Rejected


class Connections:
    def __init__(self, max_total: int, max_per_identity: int) -> None:
        self.max_total = max_total
        self.max_per_identity = max_per_identity
        self._per_identity: Counter[str] = Counter()
        self.total = 0

    def open(self, identity: str) -> None:
        """Count a new connection, or raise ``Rejected`` with Raccoon's limit codes."""
        if self.total >= self.max_total:
            raise Rejected(
                f"the server holds its maximum of {self.max_total} connections",
                status=503,
                code=Code.MAX_CONNECTION_LIMIT_REACHED,
                kind="max_connections",
            )
        if self._per_identity[identity] >= self.max_per_identity:
            raise Rejected(
                f"identity {identity!r} already has {self.max_per_identity} connection(s)",
                status=429,
                code=Code.MAX_USER_LIMIT_REACHED,
                kind="max_user_connections",
            )
        self._per_identity[identity] += 1
        self.total += 1

    def close(self, identity: str) -> None:
        self._per_identity[identity] -= 1
        if self._per_identity[identity] <= 0:
            del self._per_identity[identity]
        self.total -= 1
